"""The default local cost table (seconds per element).

Measured with ``python -m ds_lioncub.planner --calibrate --threads 1``; see
:mod:`ds_lioncub.planner.local_costs` for what each entry means.
"""

MEASURED_ON = "x86_64 Linux, 1 torch thread(s), packing path 'compiled', 2097152 elements, fastest of 5 x 5"

SECONDS_PER_ELEMENT = {
    "1bit": 9.904e-10,
    "kbit/l1/2/alltoall/vote": 8.625e-09,
    "kbit/l1/4/allreduce/vote": 5.064e-09,
    "kbit/l1/4/alltoall/vote": 7.565e-09,
    "kbit/l1/8/allreduce/vote": 3.648e-09,
    "kbit/l1/8/alltoall/vote": 6.134e-09,
    "kbit/sign/2/allreduce/vote": 3.468e-09,
    "kbit/sign/2/alltoall/vote": 7.362e-09,
    "kbit/sign/4/allreduce/vote": 4.072e-09,
    "kbit/sign/4/alltoall/vote": 4.946e-09,
    "kbit/sign/8/allreduce/vote": 2.241e-09,
    "kbit/sign/8/alltoall/vote": 4.979e-09,
    "lion_update": 4.354e-09,
    "none/bf16": 1.152e-09,
    "none/fp32": 0,
}
