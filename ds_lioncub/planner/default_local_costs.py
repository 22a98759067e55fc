"""The default local cost table (seconds per element), measured with ``python -m ds_lioncub.planner --calibrate``.

See :mod:`ds_lioncub.planner.local_costs` for what each entry means.
"""

MEASURED_ON = "x86_64 Linux, 2 torch threads, packing path 'compiled', 4194304 elements, median of 9"

SECONDS_PER_ELEMENT = {
    "1bit": 2.664e-09,
    "kbit/l1/2/alltoall/vote": 3.893e-08,
    "kbit/l1/4/allreduce/vote": 3.78e-08,
    "kbit/l1/4/alltoall/vote": 4.378e-08,
    "kbit/l1/8/allreduce/vote": 1.819e-08,
    "kbit/l1/8/alltoall/vote": 2.359e-08,
    "kbit/sign/2/allreduce/vote": 5.411e-09,
    "kbit/sign/2/alltoall/vote": 1.701e-08,
    "kbit/sign/4/allreduce/vote": 2.529e-08,
    "kbit/sign/4/alltoall/vote": 4.366e-08,
    "kbit/sign/8/allreduce/vote": 2.117e-08,
    "kbit/sign/8/alltoall/vote": 1.825e-08,
    "lion_update": 1.875e-08,
    "none/bf16": 7.626e-09,
    "none/fp32": 0,
}
