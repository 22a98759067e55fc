"""LionCub under ZeRO-3, and compressed LionCub under ZeRO-3 as a hybrid: stage 3 inside a node, the vote across nodes.

The hybrid's semantics are the ZeRO-1/2 hybrid's (:mod:`.hybrid_zero`), one stage further: inside a node
ZeRO-3 partitions the parameters, the gradients and the optimizer state over the node's G ranks and
gathers the parameters layer by layer there; rank (k, j) keeps node k's momentum for its slice of
every parameter and votes it with the ranks (k', j) of the other nodes.

How it is wired into DeepSpeed's engine, while ``DeepSpeedEngine._configure_zero_optimizer`` runs:

- the engine's data-parallel group is the rank's node group (ZeRO-3's partition count, reductions,
  overflow and norm checks and checkpoint names then describe the node; the engine keeps the world for
  batch size and its own checkpoint metadata);
- the module's parameters are partitioned over the node (``deepspeed.zero.Init(module=...,
  data_parallel_group=node)``), which DeepSpeed would otherwise do over the whole world;
- the ZeRO-3 class is :class:`HybridZeroStage3`. Stage 3 calls the optimizer's ``step()`` once per
  sub-group, with that sub-group's flat fp32 tensor as the only parameter; the class brackets the
  sub-group loop with :meth:`LionCub.engine_side.optimizer_step_in_parts`, so LionCub counts optimizer steps (the
  tie rule, momentum sync and telemetry are per step, not per call), and numbers each call's tensor by
  its sub-group in the bucket keys (:meth:`LionCub.engine_side.bucket_keys_from`: error feedback's state per
  sub-group). Under the hybrid its skip decisions (the fp16 overflow flag, and the validity of the
  gradient norm that skips fp32 and bf16 steps) are reduced over the node by ZeRO and then over the vote
  group: a NaN on any rank skips the step on every rank of every node.

Outside the hybrid (exact Lion, ``compression="none"``) only the bracketing applies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ds_lioncub.comm.transport import make_transport
from ds_lioncub.consistency.fingerprint import gather_texts
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.integration.hybrid_zero import (
    ENGINE_ATTRIBUTE,
    HybridSetup,
    any_rank,
    check_shards_match,
    clip_factor_of_shards,
    log_topology,
)
from ds_lioncub.optimizer import LionCub


def sub_group_name(index: int, parameters: int) -> str:
    """How a ZeRO-3 sub-group's flat tensor is named in LionCub's messages and checkpoint layout."""
    return f"ZeRO-3 sub-group {index} (this rank's slice of {parameters} parameter(s))"


class HybridZeroStage3(DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 whose sub-group steps are parts of one LionCub step, and whose skip decisions agree across nodes.

    ``_lioncub_vote_group`` (bound by :func:`zero3_class_for`): the ranks that vote together, one per node;
    None outside the hybrid, where ZeRO's own group is the whole world already.
    """

    _lioncub_vote_group: dist.ProcessGroup | None = None

    def _lioncub(self) -> LionCub:
        assert isinstance(self.optimizer, LionCub), "HybridZeroStage3 runs LionCub only"
        return self.optimizer

    def _flag_device(self) -> torch.device:
        return self.fp32_partitioned_groups_flat[0].device

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        overflow = bool(super().has_overflow(partition_gradients))
        if self._lioncub_vote_group is None:
            return overflow
        return any_rank(overflow, self._lioncub_vote_group, self._flag_device())

    def _get_norm_groups(self) -> list[Any]:
        norms: list[Any] = list(super()._get_norm_groups())
        if self._lioncub_vote_group is None:
            return norms
        invalid_here = any(is_invalid_grad_norm(norm) for norm in norms)
        if any_rank(invalid_here, self._lioncub_vote_group, self._flag_device()) and not invalid_here:
            # Another node's norm is invalid: report one here too, so this node skips the step with it.
            norms[0] = torch.full_like(norms[0], float("inf")) if torch.is_tensor(norms[0]) else float("inf")
        return norms

    def step(self, closure: Any = None) -> Any:
        lioncub = self._lioncub()
        if not lioncub.engine_side.sketches_each_step:
            with lioncub.engine_side.optimizer_step_in_parts():
                return super().step(closure)
        # Option clip and the noise scale: one sketch of the whole step, from every sub-group's reduced gradient,
        # before the first part (the factor is None when LionCub does not clip).
        factor = clip_factor_of_shards(lioncub, self.averaged_gradients, len(self.fp16_groups), float(self.loss_scale))
        with lioncub.engine_side.clip_coefficient_given(factor), lioncub.engine_side.optimizer_step_in_parts():
            return super().step(closure)

    def _optimizer_step(self, sub_group_id: int) -> None:
        lioncub = self._lioncub()
        names = lioncub.param_names
        # LionCub sees one flat tensor now: name it for error messages (a replica check, a non-finite gradient).
        lioncub.param_names = [sub_group_name(sub_group_id, len(self.fp16_groups[sub_group_id]))]
        try:
            # Sub-group s is tensor s of the bucket keys, so that error feedback keeps each one's state apart.
            with lioncub.engine_side.bucket_keys_from(sub_group_id):
                super()._optimizer_step(sub_group_id)
        finally:
            lioncub.param_names = names


def zero3_class_for(vote_group: dist.ProcessGroup | None) -> type[HybridZeroStage3]:
    """A :class:`HybridZeroStage3` subclass bound to ``vote_group`` (ZeRO's constructor takes no extra argument)."""
    return type("HybridZeroStage3", (HybridZeroStage3,), {"_lioncub_vote_group": vote_group})


def configure_zero3(engine: Any, configure: Any, optimizer: Any) -> Any:
    """Run the engine's ``_configure_zero_optimizer`` at stage 3 with :class:`HybridZeroStage3`; under the hybrid,
    with the parameters partitioned over the node and the node as ZeRO's group."""
    import deepspeed.runtime.zero.stage3 as stage3_module

    setup: HybridSetup | None = getattr(engine, ENGINE_ATTRIBUTE, None)
    world_group, zero_class = engine.seq_data_parallel_group, stage3_module.DeepSpeedZeroOptimizer_Stage3
    stage3_module.DeepSpeedZeroOptimizer_Stage3 = zero3_class_for(None if setup is None else setup.groups.vote_group)
    try:
        if setup is not None:
            engine.seq_data_parallel_group = setup.groups.node_group
            _partition_over_the_node(engine, setup)
        zero = configure(engine, optimizer)
    finally:
        engine.seq_data_parallel_group = world_group
        stage3_module.DeepSpeedZeroOptimizer_Stage3 = zero_class
    if isinstance(zero, HybridZeroStage3):
        _zero_the_padding(zero)
    if setup is not None and isinstance(zero, HybridZeroStage3):
        shard_sizes = [flat.numel() for flat in zero.fp32_partitioned_groups_flat]
        check_shards_match(shard_sizes, setup)
        log_topology(setup, shard_sizes, optimizer)
    return zero


def _zero_the_padding(zero: HybridZeroStage3) -> None:
    """Set the padding of the flat tensors to 0: ZeRO-3 pads the last slice of a parameter with memory it never
    initialises, which would differ from node to node (a replica check compares the slices, padding included).

    The padding is no parameter; its gradient is 0, so it only ever moves by the tie rule and weight decay.
    """
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        end = 0
        for param, padding in zip(zero.fp16_groups[i], zero.groups_padding[i], strict=True):
            end += int(param.partition_numel())
            if padding:
                flat.data[end - padding : end].zero_()
                zero.fp16_partitioned_groups_flat[i].data[end - padding : end].zero_()


def _partition_over_the_node(engine: Any, setup: HybridSetup) -> None:
    """Partition every parameter over the node, as DeepSpeed's ZeRO-3 would over the whole world.

    The engine has broadcast rank 0's parameters over the world already, so every node starts from the
    same values; ZeRO-3 then finds the parameters partitioned and keeps them so.
    """
    import deepspeed

    module = engine.module
    deepspeed.zero.Init(
        module=module,
        data_parallel_group=setup.groups.node_group,
        config_dict_or_path=engine.config,
        dtype=next(module.parameters()).dtype,
        mpu=engine.mpu,
    )


def refuse_a_model_partitioned_elsewhere(engine: Any, setup: HybridSetup) -> None:
    """Raise the same error on every rank if some parameter is partitioned over other ranks than its node.

    A model built under a plain ``deepspeed.zero.Init()`` is partitioned over the whole world; the hybrid
    partitions each parameter over its node itself. Collective over the world.
    """
    layout = setup.groups.layout
    node = list(layout.node_groups[layout.node_of(int(engine.global_rank))])
    found = ""
    for name, param in engine.module.named_parameters():
        group = getattr(param, "ds_process_group", None)
        if not hasattr(param, "ds_id") or group is None:
            continue
        ranks = sorted(dist.get_process_group_ranks(group))
        if ranks != node:
            found = f"parameter {name!r} is partitioned over {len(ranks)} ranks"
            break
    reports = gather_texts(make_transport(None, comm_backend_name="torch"), found)
    problems = sorted({report for report in reports if report})
    if problems:
        raise LionCubConfigError(
            f"LionCub: the model was already partitioned by deepspeed.zero.Init ({problems[0]}), but the ZeRO-3 "
            f"hybrid partitions each parameter over its node ({layout.node_size} ranks, {layout.nodes} node(s)) "
            f"and votes across nodes. Build the model without deepspeed.zero.Init (the hybrid partitions it when "
            f"deepspeed.initialize runs), or use compression='none' (exact Lion, ZeRO-3 over the whole world)."
        )


@contextmanager
def flat_groups_visible(engine: Any, lioncub: LionCub) -> Iterator[None]:
    """Within this block LionCub's param groups hold every ZeRO-3 sub-group's flat tensor, as ZeRO-3's own
    ``state_dict`` shows them (outside its step they are empty): its momenta and layout, for checkpoints.

    No-op for any other engine.
    """
    zero = engine.optimizer
    if not isinstance(zero, HybridZeroStage3):
        yield
        return
    names = lioncub.param_names
    zero._set_fp32_optimizer_param_groups()
    order = [i for group in range(len(lioncub.param_groups)) for i in _sub_groups_of(zero, group)]
    lioncub.param_names = [sub_group_name(i, len(zero.fp16_groups[i])) for i in order]
    try:
        yield
    finally:
        zero._clear_fp32_optimizer_param_groups()
        lioncub.param_names = names


def _sub_groups_of(zero: Any, param_group: int) -> list[int]:
    """The sub-groups of ``param_group`` in sub-group order (the order ZeRO-3 appends their flat tensors)."""
    return [i for i in range(len(zero.fp16_groups)) if zero.sub_group_to_group_id[i] == param_group]


@contextmanager
def node_zero_writes_the_model_states(engine: Any) -> Iterator[None]:
    """During a save under the ZeRO-3 hybrid, only node 0 writes DeepSpeed's model-state files.

    ZeRO-3 names them ``zero_pp_rank_{rank in its group}``, the rank in the node here, so rank (k, j) of
    every node would write the same file; node 0's are the ones every node reads back (the masters are
    identical on every node). DeepSpeed's optimizer files are node 0's already.
    """
    setup: HybridSetup | None = getattr(engine, ENGINE_ATTRIBUTE, None)
    if setup is None or setup.zero_stage != 3:
        yield
        return
    writes = engine.save_non_zero_checkpoint
    engine.save_non_zero_checkpoint = writes and int(engine.global_rank) < setup.groups.layout.node_size
    try:
        yield
    finally:
        engine.save_non_zero_checkpoint = writes


__all__ = [
    "HybridZeroStage3",
    "configure_zero3",
    "flat_groups_visible",
    "node_zero_writes_the_model_states",
    "refuse_a_model_partitioned_elsewhere",
    "sub_group_name",
    "zero3_class_for",
]
