"""The scenarios of the ZeRO-3 hybrid tests (compressed LionCub under ZeRO-3: stage 3 inside a node, vote across nodes).

Shared by the deepspeed-launched worker (tests/workers/zero3_hybrid_scenarios.py), which runs them, and by
tests/integration/test_zero3_hybrid.py, which rebuilds every rank's inputs and runs the plain-torch simulation
(tests.support.zero3_reference.simulate_hybrid_zero3). The model, inputs and option set are the ZeRO-1/2
hybrid's (tests.support.hybrid_cases): an MLP 8-16-3 of 195 parameters whose last bias (3 elements) does not
split into 2 or 4 equal slices, so ZeRO-3 pads it and the padding is exercised.

Every case runs ZeRO-3 with ``stage3_param_persistence_threshold: 0``, so every layer's parameters are
gathered inside the node in forward and backward, unless it says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tests.support.hybrid_cases import (
    BINDING_CLIP,
    DEEPSPEED_RULE,
    NAN_RANK,
    NAN_STEP,
    OPTION_CLIP,
    VOTE_STATS,
    WARMUP,
    HybridCase,
    build_model,
    kbit_l1_with_feedback,
)

# Parameters gathered per layer, and ZeRO-3's own default sub-group size (one sub-group per param group).
GATHERED: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
# Option clip's norm here: the ZeRO-3 runs' mean gradient stays below the ZeRO-1/2 cases' 0.7 (their trajectories
# differ from the first step's vote on), and 0.65 clips some of their steps and not others.
ZERO3_CLIP_NORM = 0.65
# A sub-group size that cuts the 98 elements a rank holds at G = 2 into three sub-groups (see sub_groups).
SMALL_SUB_GROUP = 20


def zero3(
    name: str, sub_group_size: int | None = None, zero: dict[str, Any] | None = None, **fields: Any
) -> HybridCase:
    """A ZeRO-3 case: ``fields`` as for HybridCase; ``zero`` adds ZeRO options to GATHERED."""
    options = {**GATHERED, **(zero or {})}
    if sub_group_size is not None:
        options["sub_group_size"] = sub_group_size
    extra = dict(fields.pop("extra", {}))
    extra["zero_optimization"] = options
    return HybridCase(name, stage=3, extra=extra, **fields)


def sub_groups(numels: list[int], partition_count: int, sub_group_size: int | None) -> list[list[int]]:
    """ZeRO-3's sub-groups of one param group, by parameter index, written from its rule: parameters in
    order, each counted by its slice (ceil(numel / G)), a sub-group closed once it reaches the size."""
    slices = [math.ceil(n / partition_count) for n in numels]
    if sub_group_size is None or sub_group_size >= sum(slices):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(slices):
        current.append(index)
        size += numel
        if size >= sub_group_size or index == len(numels) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


def sub_group_size_of(case: HybridCase) -> int | None:
    return case.extra.get("zero_optimization", {}).get("sub_group_size")


EF_CASES = [
    zero3(
        "zero3_ef_residual_2bit_alltoall_sub_groups",
        sub_group_size=SMALL_SUB_GROUP,
        options=kbit_l1_with_feedback(2, "alltoall", {"kind": "residual", "beta": 0.8, "reset_interval": 4}),
    ),
    zero3(
        "zero3_ef21_4bit_alltoall_two_param_groups",
        bias_groups=True,
        options=kbit_l1_with_feedback(4, "alltoall", {"kind": "ef21"}),
    ),
]

# Trained in the main launch and compared with the simulation, each with a fresh engine.
TRAINED = [
    zero3("zero3_1bit"),
    zero3("zero3_kbit_sign_4bit_allreduce", options={"compression": "kbit", "bits": 4, "quantizer": "sign"}),
    zero3(
        "zero3_kbit_l1_8bit_alltoall",
        options={"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "alltoall", **VOTE_STATS},
    ),
    zero3("zero3_1bit_accumulation2", accumulation=2),
    zero3("zero3_1bit_binding_clip", clipping=BINDING_CLIP, options={"compression": "1bit", "clip": DEEPSPEED_RULE}),
    zero3("zero3_1bit_warmup_lr", scheduler={"type": "WarmupLR", "params": WARMUP}),
    # Three sub-groups per rank: three step() calls per optimizer step, one tie rule and one step count.
    zero3(
        "zero3_1bit_sub_groups",
        sub_group_size=SMALL_SUB_GROUP,
        options={
            "compression": "1bit",
            "momentum_sync": {"interval": 2, "layers": "all"},
            "consistency_check": {"interval": 1},  # each sub-group's flat tensor compared across nodes, every step
            **VOTE_STATS,
        },
    ),
    zero3("zero3_1bit_sub_groups_two_param_groups", sub_group_size=SMALL_SUB_GROUP, bias_groups=True),
    # Option clip: one factor from every sub-group's flat tensor, given to all three step() calls.
    zero3(
        "zero3_1bit_option_clip_sub_groups",
        sub_group_size=SMALL_SUB_GROUP,
        options={"compression": "1bit", "clip": {**OPTION_CLIP, "max_norm": ZERO3_CLIP_NORM}},
    ),
    zero3("zero3_1bit_nan_on_one_rank", nan_at=(NAN_RANK, NAN_STEP)),
    # ZeRO-3's default persistence: small parameters stay whole on every rank, the step is the same.
    dataclasses.replace(zero3("zero3_1bit_persistent_small_parameters"), extra={"zero_optimization": {"stage": 3}}),
    # Every rank a node (ZeRO-3 over one rank: whole parameters), and one node of all ranks.
    zero3("zero3_1bit_node_size1", node_size=1),
    zero3("zero3_1bit_node_size4", node_size=4, sub_group_size=SMALL_SUB_GROUP),
    # Error feedback: each sub-group's flat tensor keeps its own state (three sub-groups, three step() calls).
    *EF_CASES,
    # Control without the hybrid: DeepSpeed's own ZeRO-3 over the 4 ranks with exact Lion.
    zero3("zero3_exact_control", node_size=None, options={"compression": "none"}, sub_group_size=SMALL_SUB_GROUP),
]
TRAINED_BY_NAME = {case.name: case for case in TRAINED}

# Trained but not simulated: bf16 forward and backward with a NaN on one rank.
BF16 = zero3("zero3_1bit_bf16_nan_on_one_rank", nan_at=(NAN_RANK, NAN_STEP), extra={"bf16": {"enabled": True}})
UNSIMULATED = [BF16]

# Saved after CHECKPOINT_AT steps in the main launch, resumed in the second (several sub-groups, so the side
# files hold several flat tensors).
CHECKPOINTED = zero3("zero3_1bit_checkpointed", sub_group_size=SMALL_SUB_GROUP)
# Error feedback's checkpoint (in ``ckpt-ef``): the residual's state of three sub-groups, its reset clock
# crossing the resume; the uninterrupted run is the trained case of the same name.
CHECKPOINTED_EF = EF_CASES[0]

# Configurations refused before training, with words the message must contain. "world_partitioned" builds
# its model under a plain deepspeed.zero.Init() (the worker knows it by name).
REFUSED: dict[str, tuple[HybridCase, tuple[str, ...]]] = {
    "hpz": (zero3("hpz", zero={"zero_hpz_partition_size": 2}), ("stage 3", "hpz", "zero_hpz_partition_size")),
    "quantized_gradients": (
        zero3("quantized_gradients", zero={"zero_quantized_gradients": True}),
        ("zero_quantized_gradients",),
    ),
    "quantized_weights": (
        zero3("quantized_weights", zero={"zero_quantized_weights": True}),
        ("zero_quantized_weights",),
    ),
    "world_partitioned": (zero3("world_partitioned"), ("deepspeed.zero.Init", "over 4 ranks", "node")),
    "optimizer_offload": (
        zero3(
            "optimizer_offload",
            zero={"offload_optimizer": {"device": "cpu"}},
            extra={"zero_force_ds_cpu_optimizer": False},
        ),
        ("offload",),
    ),
    "parameter_offload": (zero3("parameter_offload", zero={"offload_param": {"device": "cpu"}}), ("offload",)),
    "elastic_checkpoint": (zero3("elastic_checkpoint", zero={"elastic_checkpoint": True}), ("elastic",)),
    "universal_checkpoint": (
        zero3("universal_checkpoint", extra={"checkpoint": {"load_universal": True}}),
        ("universal",),
    ),
    "mpi_backend": (zero3("mpi_backend", options={"compression": "1bit", "comm_backend_name": "mpi"}), ("mpi",)),
}


def slice_sizes(node_size: int) -> list[int]:
    """Each parameter's slice on every rank of a node of ``node_size`` (ceil(numel / G))."""
    return [math.ceil(p.numel() / node_size) for p in build_model().parameters()]
