"""One rank of a 2-rank MPI job in which rank 1 stops itself (SIGSTOP) after three all-to-alls: does rank 0's
fourth ever return? (benchmarks/RESULTS.md, "A node that goes silent": MPI collectives never time out.)

    timeout -s KILL 45 mpirun -np 2 python benchmarks/mpi_silent_rank.py
    MPIEXEC_TIMEOUT=20 timeout -s KILL 60 mpirun -np 2 python benchmarks/mpi_silent_rank.py
"""

from __future__ import annotations

import os
import signal

import torch

from ds_lioncub.comm.transport import MpiTransport


def main() -> None:
    transport = MpiTransport()
    message = torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):
        transport.all_to_all(message)
    if transport.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    transport.all_to_all(message)
    print("returned", flush=True)


if __name__ == "__main__":
    main()
