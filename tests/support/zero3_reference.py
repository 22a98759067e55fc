"""A plain-torch simulation of compressed LionCub under ZeRO-3 as a hybrid (no ds_lioncub or DeepSpeed code).

The semantics of docs/design.md, section 12 (the ZeRO hybrid), at stage 3: N ranks = M nodes x G, node-major.
ZeRO-3 partitions every parameter on its own: its flattened values, zero-padded to G x ceil(numel / G),
split into G equal slices; rank (k, j) holds slice j of every parameter. The optimizer's tensors are
sub-groups of consecutive parameters of one param group: rank j's flat tensor of a sub-group is its slices of
those parameters, concatenated. Ranks (k, j) and (k', j) hold the same elements; node k keeps its own momentum.

Per engine step:

1. every rank's gradient of each micro-batch (divided by the accumulation steps, as DeepSpeed scales the loss);
2. node k's gradient: each micro-batch's gradients divided by G and summed in rank order, then the reduced
   micro-batches summed (ZeRO-3 reduces every micro-batch);
3. a non-finite gradient on any rank skips the step everywhere: nothing moves, the step count stays;
4. with clipping, each node scales its gradient by 1 / max(1, (norm + 1e-6) / clip), norm = the L2 norm of
   the node's gradient (per-node clipping); with ``sketch_clip`` = (max_norm, K) (LionCub's option clip) every
   node scales it by the factor of tests.support.clip_reference from every node's flat tensors (sub-group s,
   slice j sketched as tensor s with shard key j; the nodes' sum divided by the node count);
5. LionCub's step count advances once; per sub-group s and slice j, the nodes' flat tensors of s, j:
   c = b1*m + (1-b1)*g, m = b2*m + (1-b2)*g, aggregated across the nodes as at stage 0 (one vote per flat
   tensor: the L1 scale is its mean |c|, summed chunk-wise past ``bucket_size``), x = x*(1 - lr*wd) - lr*Delta,
   padding included;
6. every ``momentum_sync_interval`` steps the nodes' momenta are replaced by their mean.

With ``error_feedback`` (k-bit L1), step 5's aggregation of sub-group s, slice j is error feedback's
(tests.support.error_feedback_reference, tensor s of the bucket keys), with one EF state per slice j.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tests.support.clip_reference import brute_force_sketch
from tests.support.error_feedback_reference import EfState, feedback_deltas, shard_feedback
from tests.support.reference import (
    HybridGradsFn,
    _apply_update,
    _node_gradient,
    _pre_sign_update,
    _update_momentum,
    brute_force_vote_1bit,
    brute_force_vote_kbit,
)


@dataclass
class Zero3Run:
    """What every rank of a simulated ZeRO-3 hybrid job must hold.

    Attributes:
        params_per_step: the whole parameters (the same on every rank) after each engine step.
        masters: ``masters[s][j]``: slice j's flat fp32 tensor of sub-group s (the same on every node).
        momenta: ``momenta[k][s][j]``: node k's momentum of that flat tensor.
        lioncub_steps: LionCub's step count after each engine step.
        skipped: per engine step, whether every rank skipped it.
        feedback: with error feedback, ``feedback[j]``: the EF state of slice j's votes, its worker k being
            node k (rank (k, j) holds worker k's residuals or estimates).
        clip_factors: with ``sketch_clip``, the factor of every step taken.
    """

    params_per_step: list[list[Tensor]]
    masters: list[list[Tensor]]
    momenta: list[list[list[Tensor]]]
    lioncub_steps: list[int]
    skipped: list[bool]
    feedback: list[EfState] = field(default_factory=list)
    clip_factors: list[float] = field(default_factory=list)


def _slice(param: Tensor, local: int, node_size: int) -> Tensor:
    """Slice ``local`` of a parameter's flattened values, zero-padded to G x ceil(numel / G)."""
    size = math.ceil(param.numel() / node_size)
    padded = torch.zeros(size * node_size, dtype=torch.float32)
    padded[: param.numel()] = param.detach().float().reshape(-1)
    return padded[local * size : (local + 1) * size].clone()


def _flat(tensors: list[Tensor], sub_group: list[int], local: int, node_size: int) -> Tensor:
    return torch.cat([_slice(tensors[p], local, node_size) for p in sub_group])


@torch.no_grad()
def simulate_hybrid_zero3(
    init_params: list[Tensor],
    grads_fn: HybridGradsFn,
    nodes: int,
    node_size: int,
    steps: int,
    *,
    sub_groups: Sequence[Sequence[int]],
    weight_decays: Sequence[float],
    gradient_accumulation_steps: int = 1,
    gradient_clipping: float = 0.0,
    lr: float | Callable[[int], float] = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    compression: str = "1bit",
    bits: int = 4,
    quantizer: str = "sign",
    aggregation: str = "vote",
    kbit_algorithm: str = "allreduce",
    tie_break: str = "alternate",
    l1_clip: float = 2.0,
    momentum_sync_interval: int = 0,
    bucket_size: int = 1 << 23,
    error_feedback: dict[str, Any] | None = None,
    sketch_clip: tuple[float, int] | None = None,
) -> Zero3Run:
    """Simulate ``steps`` engine steps (module docstring); ``sub_groups[s]`` holds parameter indices in order and
    ``weight_decays[s]`` is its param group's decay; ``compression="none"`` is exact Lion on one node."""
    if compression == "none" and nodes != 1:
        raise ValueError("exact Lion under ZeRO-3 has one node (ZeRO shards over the whole world)")
    if sorted(p for group in sub_groups for p in group) != list(range(len(init_params))):
        raise ValueError(f"sub_groups {sub_groups} must hold every parameter index exactly once")
    beta1, beta2 = betas
    shapes = [p.shape for p in init_params]
    groups = [list(group) for group in sub_groups]
    masters = [[_flat(list(init_params), g, j, node_size) for j in range(node_size)] for g in groups]
    momenta = [[[torch.zeros_like(m) for m in per_slice] for per_slice in masters] for _ in range(nodes)]
    run = Zero3Run([], masters, momenta, [], [])
    run.feedback, feedback_options = shard_feedback(
        error_feedback,
        node_size,
        compression,
        quantizer,
        bucket_size=bucket_size,
        bits=bits,
        kbit_algorithm=kbit_algorithm,
        aggregation=aggregation,
        l1_clip=l1_clip,
    )
    params = [p.detach().float().clone() for p in init_params]
    lioncub_step = 0
    world = nodes * node_size
    for step in range(1, steps + 1):
        micro_grads = [
            [
                [g.detach().float() * (1.0 / gradient_accumulation_steps) for g in grads_fn(rank, step, micro, params)]
                for micro in range(gradient_accumulation_steps)
            ]
            for rank in range(world)
        ]
        node_grads = [_node_gradient(micro_grads, k, node_size, accumulate_after_reduce=True) for k in range(nodes)]
        if not all(bool(torch.isfinite(g).all()) for grads in node_grads for g in grads):
            run.skipped.append(True)
            run.lioncub_steps.append(lioncub_step)
            run.params_per_step.append([p.clone() for p in params])
            continue
        if sketch_clip is not None:
            factor = _sketched_clip_factor(node_grads, groups, node_size, lioncub_step + 1, sketch_clip)
            run.clip_factors.append(factor)
            for grads in node_grads:
                for g in grads:
                    if factor < 1.0:
                        g.mul_(factor)
        if gradient_clipping > 0:
            for grads in node_grads:
                norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])).float()
                coefficient = torch.clamp((norm + 1e-6) / gradient_clipping, min=1.0)
                for g in grads:
                    g.mul_(1.0 / coefficient)
        lioncub_step += 1
        step_lr = lr(step) if callable(lr) else lr
        for s, group in enumerate(groups):
            for j in range(node_size):
                flat_grads = [_flat(node_grads[k], group, j, node_size) for k in range(nodes)]
                c = [_pre_sign_update(momenta[k][s][j], flat_grads[k], beta1) for k in range(nodes)]
                for k in range(nodes):
                    _update_momentum(momenta[k][s][j], flat_grads[k], beta2)
                if error_feedback is not None:
                    shards = [[c_k] for c_k in c]
                    (delta,) = feedback_deltas(run.feedback[j], shards, lioncub_step, feedback_options, s)
                elif compression == "none":
                    delta = torch.sign(c[0])
                elif compression == "1bit":
                    delta = brute_force_vote_1bit(c, lioncub_step, tie_break)
                else:
                    delta = brute_force_vote_kbit(
                        c,
                        lioncub_step,
                        bits,
                        quantizer,
                        aggregation,
                        kbit_algorithm,
                        tie_break,
                        l1_clip,
                        bucket_size=bucket_size,
                    )
                _apply_update(masters[s][j], delta, step_lr, weight_decays[s])
        if momentum_sync_interval > 0 and lioncub_step % momentum_sync_interval == 0:
            for s in range(len(groups)):
                for j in range(node_size):
                    total = torch.zeros_like(masters[s][j])
                    for k in range(nodes):
                        total += momenta[k][s][j]
                    for k in range(nodes):
                        momenta[k][s][j].copy_(total / nodes)
        params = _whole_params(masters, groups, shapes, node_size)
        run.skipped.append(False)
        run.lioncub_steps.append(lioncub_step)
        run.params_per_step.append([p.clone() for p in params])
    return run


def _sketched_clip_factor(
    node_grads: list[list[Tensor]], groups: list[list[int]], node_size: int, step: int, sketch_clip: tuple[float, int]
) -> float:
    """Option clip's factor under the ZeRO-3 hybrid (module docstring, step 4)."""
    max_norm, bins = sketch_clip
    total = torch.zeros(bins, dtype=torch.float64)
    for grads in node_grads:
        for s, group in enumerate(groups):
            for j in range(node_size):
                total += brute_force_sketch([_flat(grads, group, j, node_size)], bins, step, shard=j, first_tensor=s)
    norm = math.sqrt(float(((total / len(node_grads)) ** 2).sum()))
    return min(1.0, max_norm / (norm + 1e-6))


def _whole_params(
    masters: list[list[Tensor]], groups: list[list[int]], shapes: list[torch.Size], node_size: int
) -> list[Tensor]:
    """Every parameter rebuilt from its G slices (what ZeRO-3 gathers), padding dropped."""
    params: list[Tensor | None] = [None] * len(shapes)
    for s, group in enumerate(groups):
        offsets = [0] * node_size
        for p in group:
            numel = math.prod(shapes[p])
            size = math.ceil(numel / node_size)
            pieces = []
            for j in range(node_size):
                pieces.append(masters[s][j][offsets[j] : offsets[j] + size])
                offsets[j] += size
            params[p] = torch.cat(pieces)[:numel].reshape(shapes[p]).clone()
    assert all(p is not None for p in params)
    return [p for p in params if p is not None]
