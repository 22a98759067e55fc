"""Local cost tables measured on GPUs (seconds per element), one per GPU, by
``python -m ds_lioncub.planner --calibrate --device cuda`` on a lent machine (2026-11-26; torch 2.11.0+cu130,
the compiled CUDA packing op; benchmarks/RESULTS.md, "On a GPU"). See :mod:`ds_lioncub.planner.local_costs`
for what each entry means and :mod:`ds_lioncub.planner.devices` for how a GPU without a table is priced.
"""

MEASURED_ON = {
    "H100": "NVIDIA H100 80GB HBM3, packing path 'compiled', 8388608 elements, median of 5 x 3",
    "H200": "NVIDIA H200, packing path 'compiled', 8388608 elements, median of 5 x 3",
}

SECONDS_PER_ELEMENT = {
    "H100": {
        "1bit": 2.002e-11,
        "kbit/l1/2/alltoall/vote": 6.328e-11,
        "kbit/l1/4/allreduce/vote": 5.51e-11,
        "kbit/l1/4/alltoall/vote": 6.086e-11,
        "kbit/l1/8/allreduce/vote": 5.584e-11,
        "kbit/l1/8/alltoall/vote": 6.041e-11,
        "kbit/sign/2/allreduce/vote": 1.721e-11,
        "kbit/sign/2/alltoall/vote": 2.314e-11,
        "kbit/sign/4/allreduce/vote": 1.619e-11,
        "kbit/sign/4/alltoall/vote": 2.348e-11,
        "kbit/sign/8/allreduce/vote": 1.634e-11,
        "kbit/sign/8/alltoall/vote": 2.319e-11,
        "lion_update": 2.838e-11,
        "none/bf16": 7.447e-12,
        "none/fp32": 0,
    },
    "H200": {
        "1bit": 1.415e-11,
        "kbit/l1/2/alltoall/vote": 4.558e-11,
        "kbit/l1/4/allreduce/vote": 3.994e-11,
        "kbit/l1/4/alltoall/vote": 4.333e-11,
        "kbit/l1/8/allreduce/vote": 3.996e-11,
        "kbit/l1/8/alltoall/vote": 4.528e-11,
        "kbit/sign/2/allreduce/vote": 1.249e-11,
        "kbit/sign/2/alltoall/vote": 1.724e-11,
        "kbit/sign/4/allreduce/vote": 1.207e-11,
        "kbit/sign/4/alltoall/vote": 1.657e-11,
        "kbit/sign/8/allreduce/vote": 1.207e-11,
        "kbit/sign/8/alltoall/vote": 1.66e-11,
        "lion_update": 2.006e-11,
        "none/bf16": 6.075e-12,
        "none/fp32": 0,
    },
}
