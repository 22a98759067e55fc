"""Compressed LionCub under ZeRO-1/2: shard inside a node, vote across nodes (ZeRO-3: :mod:`.hybrid_zero3`).

N ranks run as M nodes of G ranks (:mod:`ds_lioncub.comm.topology`). Inside a node ZeRO does what it
always does, in full precision: it reduce-scatters the gradients, keeps the master weights and the
optimizer state partitioned, and all-gathers the parameters. Each node is one Lion Cub worker:
rank (k, j) keeps node k's momentum for shard j and votes on its shard with the ranks (k', j) of
the other nodes. Every copy of shard j applies the same update, so the masters stay identical on
every node.

How it is wired into DeepSpeed's engine (whose data-parallel world stays N: batch size, the initial
broadcast and checkpoint metadata are unchanged):

- while ``DeepSpeedEngine._configure_zero_optimizer`` runs, the engine's data-parallel group is the
  rank's node group and the ZeRO-1/2 class is :class:`HybridZeroOptimizer`; both are restored after;
- :class:`HybridZeroOptimizer` makes ZeRO's skip decisions world-wide: its overflow flag and the
  validity of its gradient norm are reduced over the node (by ZeRO) and then over the vote group,
  so a NaN on any rank skips the step on every rank. Without that, one node would vote while the
  other skips, and the votes of different steps would pair up silently, then hang. It also numbers
  the param groups' shards in LionCub's bucket keys (ZeRO steps one group per call);
- LionCub communicates over the vote group; its own finite check agrees over the whole world.

Clipping: DeepSpeed's ``gradient_clipping`` clips each node's averaged gradient by that node's norm. LionCub's
option ``clip`` clips by the sketched norm of the nodes' mean gradient instead: :meth:`HybridZeroOptimizer.step`
sketches each rank's shards before ZeRO's step loop (one all-reduce over the whole world) and gives LionCub the
factor for every param group's call (:func:`clip_factor_of_shards`). The same sketch feeds the gradient noise scale
(option ``telemetry.noise_scale``, :mod:`ds_lioncub.step.noise_scale`), so it runs whenever either is on.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_invalid_grad_norm
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ds_lioncub._logging import get_logger
from ds_lioncub.comm import wire
from ds_lioncub.comm.topology import HybridGroups
from ds_lioncub.comm.transport import make_transport
from ds_lioncub.comm.transport.released import HandedOver
from ds_lioncub.consistency.fingerprint import gather_texts
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.modes import mode_of
from ds_lioncub.optimizer import LionCub

# The attribute of a DeepSpeedEngine that holds its hybrid set-up (absent: not a hybrid engine).
ENGINE_ATTRIBUTE = "_lioncub_hybrid"


@dataclass
class HybridSetup:
    """What the wiring decided for one engine: the groups, where G came from, and the ZeRO stage it runs."""

    groups: HybridGroups
    node_size_source: str
    zero_stage: int = 2


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (one byte, MAX)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.uint8, device=device)
    handed = HandedOver(value)
    dist.all_reduce(handed.tensors[0], op=dist.ReduceOp.MAX, group=group)
    handed.wait_until_released()  # gloo's worker lets go of it now, not while this process exits
    return bool(value.item())


class HybridZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1/2 inside a node whose step-skipping decisions agree across the nodes.

    ZeRO reduces its overflow flag and its gradient norm over its data-parallel group, which is
    the node here; both are then reduced over the vote group (one rank per node), which makes them
    world-wide. :func:`zero_class_for` binds the vote group.
    """

    _lioncub_vote_group: dist.ProcessGroup | None = None

    def _flag_device(self) -> torch.device:
        return self.single_partition_of_fp32_groups[0].device

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        overflow = bool(super().has_overflow(partition_gradients))
        return any_rank(overflow, self._lioncub_vote_group, self._flag_device())

    def step(self, closure: Any = None) -> Any:
        lioncub = self.optimizer
        if not isinstance(lioncub, LionCub) or not lioncub.engine_side.sketches_each_step:
            return super().step(closure)
        # ZeRO unscales and steps one param group at a time; the factor (and the noise scale) must cover them all, so
        # the sketch comes first, from the reduced gradients of this rank's shards as ZeRO will flatten them
        # (loss-scaled under fp16). None: LionCub does not clip, the sketch only measured the noise scale.
        factor = clip_factor_of_shards(lioncub, self.averaged_gradients, len(self.bit16_groups), float(self.loss_scale))
        with lioncub.engine_side.clip_coefficient_given(factor):
            return super().step(closure)

    def _optimizer_step(self, group_no: int) -> None:
        # ZeRO steps each param group's flat shard in its own LionCub.step() call: shard i is tensor i of
        # the bucket keys, so that error feedback keeps each shard's state apart.
        if isinstance(self.optimizer, LionCub):
            with self.optimizer.engine_side.bucket_keys_from(group_no):
                super()._optimizer_step(group_no)
        else:
            super()._optimizer_step(group_no)

    def scaled_global_norm(self, norm_type: int = 2) -> Any:
        norm = super().scaled_global_norm(norm_type)
        if any_rank(is_invalid_grad_norm(norm), self._lioncub_vote_group, self._flag_device()):
            # What DeepSpeed's norm helpers report for an invalid norm: ZeRO then skips the step.
            return torch.full_like(norm, float("inf")) if torch.is_tensor(norm) else float("inf")
        return norm


def gradient_pieces(reduced: Any) -> list[torch.Tensor]:
    """A ZeRO shard's reduced gradient as the pieces whose concatenation ZeRO flattens into it (its padding, zeros,
    left out): the pre-flattened partition where ZeRO keeps one, else its list of per-parameter slices."""
    if reduced is None:
        return []
    flat = getattr(reduced, "flat_partition", None)
    return [flat.view(-1)] if flat is not None else [piece for piece in reduced if piece is not None]


def clip_factor_of_shards(
    lioncub: LionCub, averaged_gradients: dict[int, Any], shards: int, loss_scale: float
) -> float | None:
    """Option ``clip``'s factor for LionCub's next step from this rank's ``shards`` reduced gradients (ZeRO's
    ``averaged_gradients``: shard i of param group i at stages 1-2, of sub-group i at stage 3, numbered as
    LionCub numbers ZeRO's calls), divided by ``loss_scale``: a collective over LionCub's agreement group (the
    world), before ZeRO's loop over the shards. The same sketch updates the noise scale when it is measured
    (the world-wide sum of the ranks' squared norms is the sum of the nodes'); None when LionCub does not clip."""
    pieces = [gradient_pieces(averaged_gradients.get(i)) for i in range(shards)]
    return lioncub.engine_side.sketch_step(pieces, lioncub.engine_side.next_step, loss_scale)


def zero_class_for(vote_group: dist.ProcessGroup | None) -> type[HybridZeroOptimizer]:
    """A :class:`HybridZeroOptimizer` subclass bound to ``vote_group`` (ZeRO's constructor takes no extra argument)."""
    return type("HybridZeroOptimizer", (HybridZeroOptimizer,), {"_lioncub_vote_group": vote_group})


def configure_hybrid_zero(engine: Any, configure: Any, optimizer: Any) -> Any:
    """Run the engine's ``_configure_zero_optimizer`` with the node as ZeRO's group and the hybrid class."""
    import deepspeed.runtime.engine as engine_module

    setup: HybridSetup = getattr(engine, ENGINE_ATTRIBUTE)
    world_group, zero_class = engine.seq_data_parallel_group, engine_module.DeepSpeedZeroOptimizer
    engine.seq_data_parallel_group = setup.groups.node_group
    engine_module.DeepSpeedZeroOptimizer = zero_class_for(setup.groups.vote_group)
    try:
        zero = configure(engine, optimizer)
    finally:
        engine.seq_data_parallel_group = world_group
        engine_module.DeepSpeedZeroOptimizer = zero_class
    shard_sizes = [p.numel() for p in zero.single_partition_of_fp32_groups]
    check_shards_match(shard_sizes, setup)
    lioncub = optimizer if isinstance(optimizer, LionCub) else None
    if lioncub is not None:
        # LionCub now steps one flat shard per param group: name them so errors say what they are.
        lioncub.param_names = [f"param group {i} (ZeRO shard)" for i in range(len(lioncub.param_groups))]
        log_topology(setup, shard_sizes, lioncub)
    return zero


def check_shards_match(shard_sizes: list[int], setup: HybridSetup) -> None:
    """Raise unless every rank of the vote group holds shards of the same sizes (the same elements)."""
    sizes = torch.tensor(shard_sizes, dtype=torch.int64)
    gathered = [torch.empty_like(sizes) for _ in range(setup.groups.layout.nodes)]
    handed = HandedOver(sizes, *gathered)
    dist.all_gather(handed.tensors[1:], handed.tensors[0], group=setup.groups.vote_group)
    handed.wait_until_released()
    if any(not torch.equal(other, sizes) for other in gathered):
        raise LionCubSetupError(
            f"LionCub: the ZeRO shards of the ranks that vote together differ in size "
            f"({[g.tolist() for g in gathered]}); every node must build the same model with the same "
            f"param groups and ZeRO settings."
        )


def log_topology(setup: HybridSetup, shard_sizes: list[int], lioncub: LionCub) -> None:
    """Say on rank 0 how the ranks are grouped and what each sends across nodes per step (one vote per shard)."""
    layout = setup.groups.layout
    if dist.get_rank() != 0:
        return
    shard = sum(shard_sizes)
    options = lioncub.options
    mode = mode_of(options)
    per_step = sum(wire.total_bytes_sent(mode.collectives(options, size, layout.nodes)) for size in shard_sizes)
    get_logger().info(
        f"LionCub hybrid ZeRO-{setup.zero_stage}: {layout.nodes} node(s) x {layout.node_size} rank(s) (node size from "
        f"{setup.node_size_source}); node groups {list(layout.node_groups)}, vote groups "
        f"{list(layout.vote_groups)}; each rank votes on {shard} elements in {len(shard_sizes)} flat shard(s) and "
        f"sends {per_step} bytes across nodes per step"
    )


def check_node_blocks_on_one_host(setup: HybridSetup) -> None:
    """When G came from the launcher, require each node block of ranks to be one machine."""
    # Over LionCub's own transport (not all_gather_object), whose collectives return only once gloo has let go.
    hosts = gather_texts(make_transport(None, comm_backend_name="torch"), socket.gethostname())
    split = [
        (k, sorted({hosts[rank] for rank in members}))
        for k, members in enumerate(setup.groups.layout.node_groups)
        if len({hosts[rank] for rank in members}) > 1
    ]
    if split:
        k, names = split[0]
        raise LionCubSetupError(
            f"LionCub: node {k} (ranks {list(setup.groups.layout.node_groups[k])}) spans hosts {names}, but the node "
            f"size {setup.groups.layout.node_size} came from {setup.node_size_source}: ranks are not numbered "
            f"machine by machine. Launch the same number of ranks on every machine, or set hybrid.node_size."
        )


__all__ = [
    "ENGINE_ATTRIBUTE",
    "HybridSetup",
    "HybridZeroOptimizer",
    "any_rank",
    "check_node_blocks_on_one_host",
    "check_shards_match",
    "clip_factor_of_shards",
    "configure_hybrid_zero",
    "gradient_pieces",
    "log_topology",
    "zero_class_for",
]
