"""Lion Cub with error feedback on N workers as a plain loop: the reference the EF tests hold the library to.

Written from docs/design.md, sections 4.1, 4.7, 4.8 and 9 (bucket plan, L1 scale, the two forms), with
torch's elementwise operations only: no ds_lioncub code. Every worker's state is kept whole (the
shared EF21 estimate ``G`` included, where the library keeps one chunk per owner); elementwise
operations do not care how a tensor is chunked, so the bits are the library's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

GradsFn = Callable[[int, int, list[Tensor]], list[Tensor]]  # (worker, step, params) -> gradients


def plan_pieces(numels: list[int], capacity: int) -> list[list[tuple[int, int, int]]]:
    """Buckets of (tensor index, offset, length) pieces (design section 9): tensors in order, a tensor
    larger than ``capacity`` cut into capacity-sized pieces, each piece joining the current bucket when
    it fits and opening a new one otherwise."""
    pieces = []
    for index, numel in enumerate(numels):
        for start in range(0, numel, capacity if numel > capacity else max(numel, 1)):
            pieces.append((index, start, min(capacity, numel - start) if numel > capacity else numel))
    buckets: list[list[tuple[int, int, int]]] = []
    filled = 0
    for piece in pieces:
        if buckets and filled + piece[2] <= capacity:
            buckets[-1].append(piece)
            filled += piece[2]
        else:
            buckets.append([piece])
            filled = piece[2]
    return buckets


@dataclass
class EfState:
    """The error feedback's state of one group of voting workers, per bucket key (tensor index, offset of its
    first piece): each worker's residual, the reset clock, each worker's EF21 estimate, the shared EF21 estimate."""

    residual: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    uses: dict[tuple[int, int], int] = field(default_factory=dict)
    estimate: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    shared: dict[tuple[int, int], Tensor] = field(default_factory=dict)


@dataclass
class EfWorld(EfState):
    """Everything the simulation keeps: the shared parameters, each worker's momenta and EF state."""

    params: list[Tensor] = field(default_factory=list)
    momenta: list[list[Tensor]] = field(default_factory=list)


def shard_feedback(
    error_feedback: dict[str, Any] | None,
    shards: int,
    compression: str,
    quantizer: str,
    **aggregation: Any,
) -> tuple[list[EfState], dict[str, Any]]:
    """What a hybrid simulation with ``error_feedback`` keeps: one EF state per shard index (none without
    feedback), and the options :func:`feedback_deltas` takes (``aggregation``: bucket_size, bits,
    kbit_algorithm, aggregation, l1_clip)."""
    if error_feedback is None:
        return [], {}
    if compression != "kbit" or quantizer != "l1":
        raise ValueError("error feedback needs compression 'kbit' with quantizer 'l1'")
    return [EfState() for _ in range(shards)], {**aggregation, "error_feedback": error_feedback}


def l1_levels(bits: int, algorithm: str, workers: int) -> int:
    top = (1 << bits) - 1
    return top // 2 if algorithm == "alltoall" else top // (2 * workers)


@torch.no_grad()
def simulate_ef(init: list[Tensor], grads_fn: GradsFn, workers: int, steps: int, options: dict[str, Any]) -> EfWorld:
    """``steps`` Lion Cub steps of ``workers`` workers with ``options["error_feedback"]`` on L1 fields.

    ``options``: lr, betas, weight_decay, bucket_size, bits, kbit_algorithm, aggregation ("vote"/"mean"),
    l1_clip (default 2.0), error_feedback; the tie rule is "alternate" (+1 on odd steps)."""
    lr, (beta1, beta2), wd = options["lr"], options["betas"], options["weight_decay"]
    momenta = [[torch.zeros_like(t).float() for t in init] for _ in range(workers)]
    world = EfWorld(params=[t.clone().float() for t in init], momenta=momenta)
    for step in range(1, steps + 1):
        grads = [[g.reshape(-1).float() for g in grads_fn(i, step, world.params)] for i in range(workers)]
        flat_m = [[m.view(-1) for m in world.momenta[i]] for i in range(workers)]
        # c from the momenta before this step (every bucket), then the momenta move
        directions = [
            [m.clone().mul_(beta1).add_(g, alpha=1 - beta1) for m, g in zip(flat_m[i], grads[i], strict=True)]
            for i in range(workers)
        ]
        for i in range(workers):
            for m, g in zip(flat_m[i], grads[i], strict=True):
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        deltas = feedback_deltas(world, directions, step, options)
        for param, delta in zip(world.params, deltas, strict=True):
            target = param.view(-1)
            if wd != 0:
                target.mul_(1 - lr * wd)
            target.add_(delta, alpha=-lr)
    return world


def feedback_deltas(
    state: EfState, directions: list[list[Tensor]], step: int, options: dict[str, Any], first_key_tensor: int = 0
) -> list[Tensor]:
    """One step's update direction per tensor (flat) that every worker applies, from ``directions[i][t]``
    (worker i's pre-sign update c of tensor t, flat), the EF state moved. Tensor t is number
    ``first_key_tensor + t`` in the bucket keys.

    ``options``: bucket_size, bits, kbit_algorithm, aggregation, l1_clip (default 2.0), error_feedback; the
    tie rule is "alternate" (+1 on odd steps)."""
    workers, numels = len(directions), [c.numel() for c in directions[0]]
    capacity, bits = options["bucket_size"], options["bits"]
    algorithm, aggregation = options.get("kbit_algorithm", "allreduce"), options.get("aggregation", "vote")
    clip, feedback = options.get("l1_clip", 2.0), options["error_feedback"]
    levels = l1_levels(bits, algorithm, workers)
    positive_ties = step % 2 == 1
    # the L1 scale's mu of a tensor cut across buckets: |c| summed over capacity-sized chunks (design 4.7)
    whole_mu: list[dict[int, Tensor]] = [{} for _ in range(workers)]
    for i in range(workers):
        for index, numel in enumerate(numels):
            if numel > capacity:
                total = torch.zeros((), dtype=torch.float32)
                for start in range(0, numel, capacity):
                    total += directions[i][index][start : start + capacity].abs().sum()
                whole_mu[i][index] = total / numel
    deltas = [torch.empty(numel) for numel in numels]
    for bucket in plan_pieces(numels, capacity):
        key = (first_key_tensor + bucket[0][0], bucket[0][1])
        sizes = [length for _, _, length in bucket]
        c = [torch.cat([directions[i][t][s : s + n] for t, s, n in bucket]) for i in range(workers)]
        if feedback["kind"] == "residual":
            sent = _residual_bucket(state, key, c, bucket, sizes, whole_mu, feedback, levels, clip)
            delta = _aggregate(sent, aggregation, positive_ties, workers, levels)
        else:
            delta = _ef21_bucket(state, key, c, sizes, levels, clip, positive_ties)
        for (t, s, n), piece in zip(bucket, delta.split(sizes), strict=True):
            deltas[t][s : s + n] = piece
    return deltas


def _per_element(values: Tensor, sizes: list[int]) -> Tensor:
    return torch.cat([values[k].expand(size) for k, size in enumerate(sizes)])


def _residual_bucket(
    world: EfState,
    key: tuple[int, int],
    c: list[Tensor],
    bucket: list[tuple[int, int, int]],
    sizes: list[int],
    whole_mu: list[dict[int, Tensor]],
    feedback: dict[str, Any],
    levels: int,
    clip: float,
) -> list[Tensor]:
    """Each worker's levels q of h = c + e; e updated (design 4.8, residual)."""
    storage = torch.bfloat16 if feedback.get("storage", "fp32") == "bf16" else torch.float32
    beta, reset = feedback.get("beta", 0.9), feedback.get("reset_interval", 0)
    workers = len(c)
    if key not in world.residual:
        world.residual[key] = [torch.zeros(c[0].numel(), dtype=storage) for _ in range(workers)]
        world.uses[key] = 0
    uses = world.uses[key]
    out = []
    for i in range(workers):
        e = world.residual[key][i]
        if reset and uses and uses % reset == 0:
            e.zero_()
        mus = [
            whole_mu[i][t] if t in whole_mu[i] else piece.abs().mean()
            for (t, _, _), piece in zip(bucket, c[i].split(sizes), strict=True)
        ]
        scales = torch.stack([levels / (clip * mu) if mu > 0 else torch.zeros(()) for mu in mus])
        s = _per_element(scales, sizes)
        h = c[i] + e.float()
        q = torch.round(h * s).clamp(-levels, levels)
        dequantized = torch.where(s > 0, q / s, torch.zeros_like(q))
        if feedback.get("feed_back", "rounding") == "rounding":  # only the rounding inside [-L/s, L/s] (s > 0)
            top = levels / s  # inf where s is 0: nothing clipped
            h = torch.where(s > 0, torch.minimum(torch.maximum(h, -top), top), h)
        e.copy_(e.float() * beta + (h - dequantized) * (1 - beta))
        out.append(q)
    world.uses[key] = uses + 1
    return out


def _aggregate(levels_sent: list[Tensor], aggregation: str, positive_ties: bool, workers: int, levels: int) -> Tensor:
    total = torch.stack(levels_sent).to(torch.int64).sum(dim=0)
    if aggregation == "mean":
        return total.float() / (workers * levels)
    positive = total >= 0 if positive_ties else total > 0
    return positive.float() * 2 - 1


def _ef21_bucket(
    world: EfState,
    key: tuple[int, int],
    c: list[Tensor],
    sizes: list[int],
    levels: int,
    clip: float,
    positive_ties: bool,
) -> Tensor:
    """EF21 with a shared scale (design 4.8): sign(G) with the tie rule; every worker's G_i and G moved."""
    workers = len(c)
    if key not in world.estimate:
        world.estimate[key] = [torch.zeros(c[0].numel()) for _ in range(workers)]
        world.shared[key] = torch.zeros(c[0].numel())
    differences = [c[i] - world.estimate[key][i] for i in range(workers)]
    spreads = torch.stack([torch.stack([piece.abs().mean() for piece in d.split(sizes)]) for d in differences])
    step = _per_element(spreads.amax(dim=0).mul(clip).div(levels), sizes)
    total = torch.zeros(c[0].numel())
    for i in range(workers):
        d = torch.where(step > 0, differences[i] / step, torch.zeros_like(step)).round().clamp(-levels, levels)
        world.estimate[key][i].add_(d * step)
        total += d  # integers, exact in fp32
    world.shared[key].add_(total.mul(step).div(workers))
    g = world.shared[key]
    positive = g >= 0 if positive_ties else g > 0
    return positive.float() * 2 - 1
