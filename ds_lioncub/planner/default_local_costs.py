"""The default local cost table (seconds per element).

Measured with ``OMP_NUM_THREADS=1 python -m ds_lioncub.planner --calibrate --threads 1``; see
:mod:`ds_lioncub.planner.local_costs` for what each entry means.
"""

MEASURED_ON = "x86_64 Linux, 1 torch thread(s), packing path 'compiled', 8388608 elements, median of 5 x 3"

SECONDS_PER_ELEMENT = {
    "1bit": 1.392e-09,
    "kbit/l1/2/alltoall/vote": 1.256e-08,
    "kbit/l1/4/allreduce/vote": 1.22e-08,
    "kbit/l1/4/alltoall/vote": 1.269e-08,
    "kbit/l1/8/allreduce/vote": 8.071e-09,
    "kbit/l1/8/alltoall/vote": 1.212e-08,
    "kbit/sign/2/allreduce/vote": 5.53e-09,
    "kbit/sign/2/alltoall/vote": 7.653e-09,
    "kbit/sign/4/allreduce/vote": 5.881e-09,
    "kbit/sign/4/alltoall/vote": 8.012e-09,
    "kbit/sign/8/allreduce/vote": 4.103e-09,
    "kbit/sign/8/alltoall/vote": 7.457e-09,
    "lion_update": 8.316e-09,
    "none/bf16": 4.712e-09,
    "none/fp32": 0,
}
