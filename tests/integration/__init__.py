"""Jobs started by the real launchers: the deepspeed launcher and mpirun."""
