"""The device dimension of the planner: which local cost table and which link efficiencies a device gets.

CPU ranks take the measured table (:data:`~ds_lioncub.planner.local_costs.DEFAULT_LOCAL_COSTS`) and
gloo's link efficiencies. CUDA ranks take NCCL's link efficiencies and a GPU's table: the one measured
on that GPU where there is one (:mod:`ds_lioncub.planner.gpu_local_costs`: the H100 and the H200), else
the H100's scaled by memory bandwidth (the H100's over the GPU's: :data:`GPU_MEMORY_BANDWIDTH`, or the
user's figure). ``python -m ds_lioncub.planner --calibrate`` on a CUDA machine, then ``--local-costs``,
replaces either with the user's own.

Why scaling by bandwidth holds: the local work is element-wise passes over a bucket, bound by memory
bandwidth. :func:`derived_gpu_costs` counts the bytes of exactly the passes ``--calibrate`` times
(:mod:`ds_lioncub.planner.calibrate`: Lion's update as torch's separate element-wise operations, each
aggregation as ``build_aggregation`` runs it on rank 0 of :data:`DERIVED_WORLD` ranks) over the
bandwidth. That is a lower bound: it leaves out kernel launches and Python per call, and kernels
reaching less than the peak. Measured on an H100 and an H200, the tables are 1.3-9x that bound, by
nearly the same factor on both GPUs (benchmarks/RESULTS.md, "On a GPU"): the H100 table scaled by
3.35/4.8 predicts every H200 aggregation entry within 8% (1-bit within 1.3%). So the factor belongs to the
code, not the GPU, and the H100's measured table times the bandwidth ratio prices a GPU of the
same kind (A100, B200) better than the bound does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner import gpu_local_costs
from ds_lioncub.planner.calibrate import calibration_modes, calibration_world
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LION_UPDATE, LocalCosts, aggregation_key
from ds_lioncub.planner.model import GLOO_LINK_EFFICIENCY, LinkEfficiency

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")

# NCCL's rings and all-to-alls come near the link rate; no measurement of ours says otherwise yet (the
# GPUs lent so far were single ones: no link between two GPUs to measure), so the full rate until one does.
NCCL_LINK_EFFICIENCY = LinkEfficiency(ring=1.0, all_to_all=1.0)

# Peak memory bandwidth per GPU, bytes per second, from the vendor's datasheets (SXM parts):
# A100 80GB 2,039 GB/s; H100 80GB 3.35 TB/s; H200 141GB 4.8 TB/s; B200 8 TB/s.
GPU_MEMORY_BANDWIDTH: dict[str, float] = {"A100": 2.039e12, "H100": 3.35e12, "H200": 4.8e12, "B200": 8.0e12}
DEFAULT_GPU = "H100"
# The GPU whose measured table prices the GPUs without one (scaled by bandwidth).
REFERENCE_GPU = "H100"

# The world the derived table assumes, as --calibrate measures: only the all-to-all owner's passes
# depend on it (the owner handles p rows of n/p elements), and little.
DERIVED_WORLD = 4
FP32, BF16, BOOL, INT32 = 4, 2, 1, 4  # bytes per element of the tensors the passes read and write
SIGN_BITS = 1 / 8  # a packed sign: one bit per element


@dataclass(frozen=True)
class Pass:
    """One pass over a bucket: bytes read and written per element of the bucket."""

    name: str
    read: float
    written: float

    @property
    def bytes(self) -> float:
        return self.read + self.written


def lion_update_passes() -> list[Pass]:
    """Lion's update as ``calibrate`` times it (``lion.py``'s functions, one torch operation per pass, fp32)."""
    return [
        Pass("direction = m", FP32, FP32),
        Pass("direction *= beta1", FP32, FP32),
        Pass("direction += (1 - beta1) g", 2 * FP32, FP32),
        Pass("m *= beta2", FP32, FP32),
        Pass("m += (1 - beta2) g", 2 * FP32, FP32),
        Pass("sign(direction)", FP32, FP32),
        Pass("p *= 1 - lr wd", FP32, FP32),
        Pass("p += -lr direction", 2 * FP32, FP32),
    ]


def aggregation_passes(params: dict[str, Any], world: int = DERIVED_WORLD) -> list[Pass]:
    """The local passes of one aggregation (LionCub params) on one rank of ``world``, per bucket element.

    Exact modes: the fp32 all-reduce's sums are the collective's own (none here); bf16 converts and
    back. Compressed modes (aggregation "vote"): pack the fp32 update, the vote, unpack the voted
    signs into the fp32 result; an all-to-all's owner works on its 1/p share of every rank's row.
    """
    p = world
    compression = params["compression"]
    if compression == "none":
        if params.get("comm_dtype", "fp32") == "fp32":
            return []
        return [Pass("to bf16", FP32, BF16), Pass("to fp32", BF16, FP32)]
    unpack = Pass("unpack the voted signs", SIGN_BITS, FP32)
    if compression == "1bit":
        return [Pass("pack signs", FP32, SIGN_BITS), Pass("vote (owner)", SIGN_BITS, SIGN_BITS / p), unpack]
    if params.get("aggregation", "vote") != "vote":
        raise LionCubConfigError("LionCub: the derived GPU table covers the k-bit votes only (aggregation 'vote').")
    field = params["bits"] / 8
    passes = []
    if params["quantizer"] == "l1":  # the bucket's mean |c| (its L1 scale), then quantize and pack
        passes += [Pass("abs", FP32, FP32), Pass("mean", FP32, 0), Pass("quantize and pack fields", FP32, field)]
    else:
        passes.append(Pass("pack sign fields", FP32, field))
    if params["kbit_algorithm"] == "allreduce":  # every rank decodes the summed fields of the whole bucket
        passes += [
            Pass("unpack field sums", field, BOOL),
            Pass("sum >= threshold", BOOL, BOOL),
            Pass("pack votes", BOOL, SIGN_BITS),
        ]
    else:  # the owner sums its chunk of every row in int32, votes, packs; the votes are all-gathered
        passes += [
            Pass("sum fields (owner)", field, INT32 / p),
            Pass("sum >= threshold (owner)", INT32 / p, BOOL / p),
            Pass("pack votes (owner)", BOOL / p, SIGN_BITS / p),
        ]
    return passes + [unpack]


def derived_gpu_costs(bandwidth: float, gpu: str | None = None) -> LocalCosts:
    """The local cost table of a GPU with ``bandwidth`` bytes per second of memory bandwidth (see the module)."""
    _check_bandwidth(bandwidth)
    entries: dict[str, list[Pass]] = {
        LION_UPDATE: lion_update_passes(),
        "none/fp32": aggregation_passes({"compression": "none"}),
        "none/bf16": aggregation_passes({"compression": "none", "comm_dtype": "bf16"}),
    }
    for params in calibration_modes():
        if calibration_world(params) is not None:  # the modes --calibrate measures (2-bit L1 all-reduce holds no pair)
            entries[aggregation_key(parse_config(params))] = aggregation_passes(params)
    table = {key: sum(step.bytes for step in passes) / bandwidth for key, passes in entries.items()}
    whose = f"the {gpu}'s " if gpu else ""
    measured_on = (
        f"derived, not measured: each pass's bytes per element over {whose}{format_bandwidth(bandwidth)} of "
        f"memory bandwidth"
    )
    return LocalCosts(table, measured_on, device="cuda")


def format_bandwidth(bandwidth: float) -> str:
    """Memory bandwidth as datasheets write it: ``3.35e12`` -> ``"3.35 TB/s"``."""
    for scale, name in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s")):
        if bandwidth >= scale:
            return f"{bandwidth / scale:.3g} {name}"
    return f"{bandwidth:.3g} B/s"


def gpu_bandwidth(name: str) -> float:
    """The memory bandwidth of a GPU named in :data:`GPU_MEMORY_BANDWIDTH` (case-insensitive)."""
    for known, bandwidth in GPU_MEMORY_BANDWIDTH.items():
        if name.strip().upper() == known:
            return bandwidth
    raise LionCubConfigError(
        f"LionCub: no memory bandwidth known for the GPU {name!r} (known: {', '.join(GPU_MEMORY_BANDWIDTH)}); "
        f"give its rate instead, e.g. --device-bandwidth 3.35TB/s (network.device_bandwidth under 'auto')."
    )


def measured_gpu_costs(gpu: str) -> LocalCosts | None:
    """The table measured on ``gpu`` (:mod:`ds_lioncub.planner.gpu_local_costs`), or None if there is none."""
    name = gpu.strip().upper()
    if name not in gpu_local_costs.SECONDS_PER_ELEMENT:
        return None
    return LocalCosts(
        gpu_local_costs.SECONDS_PER_ELEMENT[name], f"measured: {gpu_local_costs.MEASURED_ON[name]}", device="cuda"
    )


def scaled_gpu_costs(bandwidth: float, gpu: str | None = None) -> LocalCosts:
    """The :data:`REFERENCE_GPU`'s measured table scaled to a GPU of ``bandwidth`` bytes per second."""
    _check_bandwidth(bandwidth)
    reference = measured_gpu_costs(REFERENCE_GPU)
    assert reference is not None  # shipped with the package
    factor = GPU_MEMORY_BANDWIDTH[REFERENCE_GPU] / bandwidth
    table = {key: value * factor for key, value in reference.seconds_per_element.items()}
    whose = f"the {gpu}'s " if gpu else ""
    measured_on = (
        f"the {REFERENCE_GPU}'s measured table scaled by memory bandwidth, "
        f"{format_bandwidth(GPU_MEMORY_BANDWIDTH[REFERENCE_GPU])} over {whose}{format_bandwidth(bandwidth)}"
    )
    return LocalCosts(table, measured_on, device="cuda")


def local_costs_for(device: Device, bandwidth: float | None = None, gpu: str | None = None) -> LocalCosts:
    """The default table for ``device``: the built-in CPU table; for CUDA, ``gpu``'s measured table (default
    :data:`DEFAULT_GPU`), else the reference GPU's scaled to ``bandwidth`` or to ``gpu``'s bandwidth."""
    if device == "cpu":
        if bandwidth is not None or gpu is not None:
            raise LionCubConfigError(
                "LionCub: a GPU or a device bandwidth prices CUDA ranks; drop it, or plan for --device cuda."
            )
        return DEFAULT_LOCAL_COSTS
    if bandwidth is not None:
        return scaled_gpu_costs(bandwidth, gpu)
    gpu = (gpu or DEFAULT_GPU).strip().upper()
    measured = measured_gpu_costs(gpu)
    return measured if measured is not None else scaled_gpu_costs(gpu_bandwidth(gpu), gpu)


def link_efficiency_for(device: Device) -> LinkEfficiency:
    """The transport a device's ranks use: gloo on CPU, NCCL on CUDA."""
    return NCCL_LINK_EFFICIENCY if device == "cuda" else GLOO_LINK_EFFICIENCY


def device_of(device_type: str) -> Device:
    """The planner's device for a torch device type: "cuda" for CUDA, "cpu" for everything else."""
    return "cuda" if device_type == "cuda" else "cpu"


def this_machines_device(cuda_available: Callable[[], bool] | None = None) -> Device:
    """What ``compression="auto"`` would plan for here: CUDA where torch sees a CUDA device and DeepSpeed's
    accelerator (``DS_ACCELERATOR``) is not set to another, else CPU."""
    accelerator = os.environ.get("DS_ACCELERATOR", "cuda")
    if accelerator != "cuda":
        return "cpu"
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    return "cuda" if cuda_available() else "cpu"


def _check_bandwidth(bandwidth: float) -> None:
    if not (bandwidth > 0 and bandwidth != float("inf")):
        raise LionCubConfigError(f"LionCub: a device bandwidth must be positive and finite, got {bandwidth!r}.")


__all__ = [
    "DEFAULT_GPU",
    "REFERENCE_GPU",
    "DERIVED_WORLD",
    "DEVICES",
    "GPU_MEMORY_BANDWIDTH",
    "NCCL_LINK_EFFICIENCY",
    "Device",
    "Pass",
    "aggregation_passes",
    "derived_gpu_costs",
    "device_of",
    "format_bandwidth",
    "gpu_bandwidth",
    "lion_update_passes",
    "link_efficiency_for",
    "local_costs_for",
    "measured_gpu_costs",
    "scaled_gpu_costs",
    "this_machines_device",
]
