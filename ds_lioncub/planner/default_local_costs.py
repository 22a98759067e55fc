"""The default local cost table (seconds per element), measured with ``python -m ds_lioncub.planner --calibrate``.

See :mod:`ds_lioncub.planner.local_costs` for what each entry means.
"""

MEASURED_ON = "x86_64 Linux, 2 torch threads, packing path 'compiled', 2097152 elements, fastest of 5 x 5"

SECONDS_PER_ELEMENT = {
    "1bit": 3.08e-09,
    "kbit/l1/2/alltoall/vote": 2.175e-08,
    "kbit/l1/4/allreduce/vote": 1.506e-08,
    "kbit/l1/4/alltoall/vote": 1.91e-08,
    "kbit/l1/8/allreduce/vote": 1.218e-08,
    "kbit/l1/8/alltoall/vote": 1.64e-08,
    "kbit/sign/2/allreduce/vote": 1.546e-08,
    "kbit/sign/2/alltoall/vote": 1.199e-08,
    "kbit/sign/4/allreduce/vote": 1.16e-08,
    "kbit/sign/4/alltoall/vote": 1.26e-08,
    "kbit/sign/8/allreduce/vote": 1.208e-09,
    "kbit/sign/8/alltoall/vote": 1.231e-08,
    "lion_update": 1.261e-08,
    "none/bf16": 6.553e-10,
    "none/fp32": 0,
}
