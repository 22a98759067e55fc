"""Independent reference implementations for the ds_lioncub tests.

Every function here takes the inputs of ALL ranks at once (one tensor per rank) and computes, by
brute force, what every rank must end up with. Nothing is bit-packed and nothing is communicated:
the point is to be obviously correct, written from the algorithms' definitions (the tie rule, the 1-bit
majority vote, k-bit sign and L1 fields with vote or mean, Lion's update, momentum sync, DeepSpeed's
legacy error-compensated 1-bit all-reduce) rather than from the library, so that a bug in the
packed/distributed implementation cannot hide in a shared helper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tests.support.error_feedback_reference import EfState, feedback_deltas, shard_feedback
from tests.support.l1_reference import l1_quantize, l1_quantize_segments  # noqa: F401 - l1_quantize: tests import it from here

TIE_BREAKS = ("alternate", "positive")
KBIT_BITS = (2, 4, 8)
QUANTIZERS = ("sign", "l1")
AGGREGATIONS = ("vote", "mean")
ALGORITHMS = ("allreduce", "alltoall")
COMPRESSIONS = ("none", "1bit", "kbit")
LIONCUB_BUCKET_SIZE = 1 << 23  # LionCub's default bucket_size (docs/options.md)


# ----------------------------------------------------------------------------------------------
# tie rule and votes
# ----------------------------------------------------------------------------------------------


def tie_value(step: int, tie_break: str) -> int:
    """The value (+1 or -1) an exact zero resolves to at optimizer step `step` (1-based)."""
    if tie_break == "positive":
        return 1
    if tie_break == "alternate":
        # Odd steps lean +1, even steps -1, so ties do not bias the parameters over time.
        return 1 if step % 2 == 1 else -1
    raise ValueError(f"unknown tie_break {tie_break!r}")


def _resolve_sign(x: Tensor, tie: int) -> Tensor:
    """int64 tensor of +1/-1: the sign of x with exact zeros replaced by `tie`."""
    return torch.where(x > 0, 1, torch.where(x < 0, -1, tie)).to(torch.int64)


def _check_ranks(updates: Sequence[Tensor]) -> None:
    if len(updates) == 0:
        raise ValueError("need the inputs of at least one rank")
    for u in updates:
        if u.shape != updates[0].shape or u.dtype != updates[0].dtype:
            raise ValueError("every rank must pass a tensor of the same shape and dtype")


def brute_force_vote_1bit(updates: list[Tensor], step: int, tie_break: str = "alternate") -> Tensor:
    """Majority vote of the local signs of all ranks; +1/-1 in the inputs' dtype and shape."""
    _check_ranks(updates)
    tie = tie_value(step, tie_break)
    vote_sum = torch.zeros(updates[0].shape, dtype=torch.int64)
    for u in updates:  # each rank contributes exactly one +1 or -1 per coordinate
        vote_sum += _resolve_sign(u, tie)
    return _resolve_sign(vote_sum, tie).to(updates[0].dtype)


def l1_levels_allreduce(world_size: int, bits: int) -> int:
    """L = floor((2**bits - 1) / (2p)): the largest L whose p-fold sum of fields (q + L) fits."""
    return (2**bits - 1) // (2 * world_size)


def l1_levels(world_size: int, bits: int, algorithm: str) -> int:
    """Quantisation levels L of the l1 quantizer for the given k-bit algorithm."""
    if algorithm == "allreduce":
        return l1_levels_allreduce(world_size, bits)
    if algorithm == "alltoall":
        # Phase 1 sums in int32 on the receiving rank, so L depends only on the field width.
        return (2**bits - 1) // 2
    raise ValueError(f"unknown algorithm {algorithm!r}")


def max_world_size_allreduce(bits: int, quantizer: str) -> int:
    """Largest p with p*R <= 2**bits - 1 (R = 1 for sign, 2L for l1 with L >= 1)."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"unknown quantizer {quantizer!r}")
    limit = 2**bits - 1

    def fits(p: int) -> bool:
        if quantizer == "sign":
            return p * 1 <= limit
        levels = l1_levels_allreduce(p, bits)
        return levels >= 1 and p * 2 * levels <= limit

    # Counting up is slow but leaves no room for an off-by-one in a closed form.
    p = 0
    while fits(p + 1):
        p += 1
    return p


def maxnorm_quantize(c: Tensor, levels: int) -> Tensor:
    """Max-norm quantizer baseline: int32 q = round(c / max|c| * L) (all zeros if c == 0)."""
    work = c if c.dtype in (torch.float32, torch.float64) else c.float()
    if work.numel() == 0:
        return torch.zeros(c.shape, dtype=torch.int32)
    peak = work.abs().max()
    if float(peak) == 0.0:
        return torch.zeros(c.shape, dtype=torch.int32)
    return torch.round(work / peak * levels).to(torch.int32)


def brute_force_vote_kbit(
    updates: list[Tensor],
    step: int,
    bits: int,
    quantizer: str = "sign",
    aggregation: str = "vote",
    algorithm: str = "allreduce",
    tie_break: str = "alternate",
    l1_clip: float = 2.0,
    segment_sizes: list[int] | None = None,
    bucket_size: int | None = None,
) -> Tensor:
    """What vote_kbit must return on every rank, from the updates of all ranks.

    L1 fields: each segment's mu is its mean |c|, summed chunk-wise past ``bucket_size`` as the optimizer
    sums a tensor cut across buckets (tests.support.l1_reference); None: never (``vote_kbit`` itself)."""
    _check_ranks(updates)
    p = len(updates)
    if bits not in KBIT_BITS:
        raise ValueError(f"bits must be one of {KBIT_BITS}, got {bits}")
    for name, value, allowed in (
        ("quantizer", quantizer, QUANTIZERS),
        ("aggregation", aggregation, AGGREGATIONS),
        ("algorithm", algorithm, ALGORITHMS),
        ("tie_break", tie_break, TIE_BREAKS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if algorithm == "allreduce" and p > max_world_size_allreduce(bits, quantizer):
        raise ValueError(
            f"world size {p} too large for {bits}-bit {quantizer} allreduce "
            f"(max {max_world_size_allreduce(bits, quantizer)})"
        )
    tie = tie_value(step, tie_break)
    shape, dtype = updates[0].shape, updates[0].dtype

    total = torch.zeros(updates[0].numel(), dtype=torch.int64)
    if quantizer == "sign":
        for u in updates:
            total += _resolve_sign(u.flatten(), tie)
        denominator = p
    else:
        levels = l1_levels(p, bits, algorithm)
        for u in updates:
            total += l1_quantize_segments(u.flatten(), levels, l1_clip, segment_sizes, bucket_size).to(torch.int64)
        denominator = p * levels

    if aggregation == "vote":
        out = _resolve_sign(total, tie)
    else:
        # total/denominator is a ratio of small integers: float64 then one cast rounds it correctly.
        out = total.to(torch.float64) / denominator
    return out.to(dtype).reshape(shape)


@dataclass
class VoteStats:
    """What a vote's telemetry must report: the tied fraction, and each rank's agreement fraction."""

    tie_rate: float
    agreement_rates: list[float]


def brute_force_vote_stats(
    updates: list[Tensor],
    step: int,
    compression: str = "1bit",
    bits: int = 4,
    quantizer: str = "sign",
    algorithm: str = "allreduce",
    tie_break: str = "alternate",
    l1_clip: float = 2.0,
    segment_sizes: list[int] | None = None,
    bucket_size: int | None = None,
) -> VoteStats:
    """From every rank's update c: the fraction of elements whose summed vote (the ranks' ±1, or
    their L1 levels q) is 0, and per rank the fraction whose own sign (zeros by the tie rule) equals
    the sign of that sum (0 by the tie rule): the applied sign of a vote, and of a mean. ``bucket_size``: as
    :func:`brute_force_vote_kbit`'s."""
    _check_ranks(updates)
    tie = tie_value(step, tie_break)
    flat = [u.flatten() for u in updates]
    total = torch.zeros(flat[0].numel(), dtype=torch.int64)
    for u in flat:
        if compression == "1bit" or quantizer == "sign":
            total += _resolve_sign(u, tie)
        else:
            levels = l1_levels(len(flat), bits, algorithm)
            total += l1_quantize_segments(u, levels, l1_clip, segment_sizes, bucket_size).to(torch.int64)
    applied = _resolve_sign(total, tie)
    numel = total.numel()
    tied = sum(1 for value in total.tolist() if value == 0)
    agreements = [
        sum(1 for a, b in zip(_resolve_sign(u, tie).tolist(), applied.tolist(), strict=True) if a == b) for u in flat
    ]
    return VoteStats(tied / numel, [count / numel for count in agreements])


def brute_force_vote_stats_for_options(
    updates: list[Tensor],
    step: int,
    options: Mapping[str, object],
    segment_sizes: list[int] | None = None,
    bucket_size: int | None = None,
) -> VoteStats:
    """:func:`brute_force_vote_stats` for a LionCub options dict (LionCub's defaults where one is unset);
    ``bucket_size`` when given stands for the options' (the scenarios set it apart from their options)."""
    return brute_force_vote_stats(
        updates,
        step,
        compression=str(options["compression"]),
        bits=int(str(options.get("bits", 4))),
        quantizer=str(options.get("quantizer", "sign")),
        algorithm=str(options.get("kbit_algorithm", "allreduce")),
        tie_break=str(options.get("tie_break", "alternate")),
        l1_clip=float(str(options.get("l1_clip", 2.0))),
        segment_sizes=segment_sizes,
        bucket_size=int(str(options.get("bucket_size", LIONCUB_BUCKET_SIZE))) if bucket_size is None else bucket_size,
    )


def reference_bucket_sizes(numels: list[int], capacity: int) -> list[int]:
    """Elements per bucket (docs/design.md, section 9): tensors in order, a tensor that fits a bucket
    is never cut (it opens a new bucket when it does not fit the current one), a larger one is cut
    into capacity-sized pieces that fill buckets the same way; empty tensors are skipped."""
    pieces = []
    for numel in numels:
        if numel <= capacity:
            pieces += [numel] if numel else []
        else:
            whole, rest = divmod(numel, capacity)
            pieces += [capacity] * whole + ([rest] if rest else [])
    sizes: list[int] = []
    for piece in pieces:
        if sizes and sizes[-1] + piece <= capacity:
            sizes[-1] += piece
        else:
            sizes.append(piece)
    return sizes


# ----------------------------------------------------------------------------------------------
# legacy error-compensated 1-bit allreduce (DeepSpeed <= 0.19.7 compressed_allreduce semantics)
# ----------------------------------------------------------------------------------------------


def _sgn_zero_positive(x: Tensor) -> Tensor:
    # The legacy backend encodes x >= 0 as bit 1, so 0 (and -0.0) count as +1.
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def reference_compressed_allreduce(
    buffers: list[Tensor],
    worker_errors: list[Tensor],
    server_errors: list[Tensor],
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Simulate compressed_allreduce on all ranks; returns (outputs, worker_errors, server_errors).

    Inputs are not modified. Outputs have each buffer's shape and dtype; errors keep their dtype.
    Rank j owns (server side) chunk j of length n_pad / p of the padded vector.
    """
    _check_ranks(buffers)
    p = len(buffers)
    n = buffers[0].numel()
    n_pad = worker_errors[0].numel()
    if len(worker_errors) != p or len(server_errors) != p:
        raise ValueError("need one worker error and one server error per rank")
    if n_pad % (8 * p) != 0 or n_pad < n:
        raise ValueError(f"worker_error numel {n_pad} must be a multiple of {8 * p} and >= {n}")
    if any(e.numel() != n_pad for e in worker_errors) or any(e.numel() != n_pad // p for e in server_errors):
        raise ValueError("inconsistent error sizes")
    chunk = n_pad // p

    # Phase 1, on every worker: error-compensate, then compress to (scale, signs).
    worker_scales: list[Tensor] = []
    worker_signs: list[Tensor] = []
    new_worker_errors: list[Tensor] = []
    for r in range(p):
        x = torch.zeros(n_pad, dtype=compute_dtype)
        x[:n] = buffers[r].flatten().to(compute_dtype)
        x += worker_errors[r].flatten().to(compute_dtype)
        scale = torch.linalg.vector_norm(x) / math.sqrt(n_pad)
        signs = _sgn_zero_positive(x)
        worker_scales.append(scale)
        worker_signs.append(signs)
        new_worker_errors.append((x - scale * signs).to(worker_errors[r].dtype).reshape(worker_errors[r].shape))

    # Phase 2, on server j: average everyone's chunk j, error-compensate, compress again.
    pieces: list[Tensor] = []
    new_server_errors: list[Tensor] = []
    for j in range(p):
        y = torch.zeros(chunk, dtype=compute_dtype)
        for r in range(p):
            y += worker_signs[r][j * chunk : (j + 1) * chunk] * (worker_scales[r] * (1.0 / p))
        y += server_errors[j].flatten().to(compute_dtype)
        scale = torch.linalg.vector_norm(y) / math.sqrt(chunk)
        signs = _sgn_zero_positive(y)
        new_server_errors.append((y - scale * signs).to(server_errors[j].dtype).reshape(server_errors[j].shape))
        pieces.append(scale * signs)

    # All-gather: every rank decodes the same full vector, then drops the padding.
    result = torch.cat(pieces)[:n].to(buffers[0].dtype).reshape(buffers[0].shape)
    return [result.clone() for _ in range(p)], new_worker_errors, new_server_errors


# ----------------------------------------------------------------------------------------------
# Lion and the simulated distributed LionCub optimizer
# ----------------------------------------------------------------------------------------------


def _pre_sign_update(exp_avg: Tensor, grad: Tensor, beta1: float) -> Tensor:
    """c = b1*m + (1-b1)*g in fp32 (the idiom lion-pytorch uses)."""
    return exp_avg.float().mul(beta1).add(grad.float(), alpha=1 - beta1)


def _apply_update(param: Tensor, delta: Tensor, lr: float, weight_decay: float) -> None:
    """p = p*(1 - lr*wd) - lr*Delta, computed in fp32 (at least) and stored back in place."""
    new = param.float().mul(1 - lr * weight_decay).add(delta.float(), alpha=-lr)
    param.copy_(new)


def _update_momentum(exp_avg: Tensor, grad: Tensor, beta2: float) -> None:
    """m = b2*m + (1-b2)*g, computed in fp32 (at least) and stored back in place."""
    exp_avg.copy_(exp_avg.float().mul(beta2).add(grad.float(), alpha=1 - beta2))


@torch.no_grad()
def reference_lion_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """One exact (single-process) Lion step, in place on params and exp_avgs; sign(0) = 0."""
    beta1, beta2 = betas
    for param, grad, exp_avg in zip(params, grads, exp_avgs, strict=True):
        c = _pre_sign_update(exp_avg, grad, beta1)
        _apply_update(param, torch.sign(c), lr, weight_decay)
        _update_momentum(exp_avg, grad, beta2)


GradsFn = Callable[[int, int, list[Tensor]], list[Tensor]]


@torch.no_grad()
def simulate_lioncub(
    init_params: list[Tensor],
    grads_fn: GradsFn,
    world_size: int,
    steps: int,
    *,
    lr: float | Callable[[int], float] = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    compression: str = "1bit",
    bits: int = 4,
    quantizer: str = "sign",
    aggregation: str = "vote",
    kbit_algorithm: str = "allreduce",
    tie_break: str = "alternate",
    l1_clip: float = 2.0,
    momentum_sync_interval: int = 0,
    momentum_sync_params: Sequence[int] | None = None,
    pre_sign_updates: list[list[Tensor]] | None = None,
    bucket_size: int = LIONCUB_BUCKET_SIZE,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Simulate LionCub on `world_size` ranks for `steps` steps.

    grads_fn(rank, step, params) returns that rank's gradients at 1-based `step` for the current
    (shared) params, which it receives as clones. lr may be a callable of the step (a schedule).
    momentum_sync_params: indices of the params whose exp_avg is averaged every
    momentum_sync_interval steps (None = all). pre_sign_updates: if given, each compressed step
    appends every rank's flat c (params in order) to it. ``bucket_size``: LionCub's, for the L1 scale of a
    tensor longer than a bucket (tests.support.l1_reference). Returns (final params, exp_avgs[rank][param]).
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    p = world_size
    beta1, beta2 = betas
    # Parameters are identical on every rank in every mode, so one copy stands for all of them.
    params = [t.detach().clone() for t in init_params]
    exp_avgs = [[torch.zeros_like(t) for t in params] for _ in range(p)]
    numels = [t.numel() for t in params]

    for step in range(1, steps + 1):
        step_lr = lr(step) if callable(lr) else lr
        grads = [[g.detach() for g in grads_fn(rank, step, [t.clone() for t in params])] for rank in range(p)]

        if compression == "none":
            # Data-parallel average first (fp32, rank order), then every rank runs exact Lion.
            mean_grads = []
            for i, t in enumerate(params):
                total = torch.zeros(t.shape, dtype=torch.float32)
                for rank in range(p):
                    total += grads[rank][i].float()
                mean_grads.append((total / p).to(t.dtype))
            shared_before = [t.clone() for t in params]
            for rank in range(p):
                rank_params = [t.clone() for t in shared_before]
                reference_lion_step(rank_params, mean_grads, exp_avgs[rank], step_lr, betas, weight_decay)
            params = rank_params
        else:
            # c from each rank's own (pre-update) momentum, flattened over params in order.
            flat_c = [
                torch.cat(
                    [_pre_sign_update(m, g, beta1).flatten() for m, g in zip(exp_avgs[rank], grads[rank], strict=True)]
                )
                if params
                else torch.zeros(0)
                for rank in range(p)
            ]
            if pre_sign_updates is not None:
                pre_sign_updates.append([c.clone() for c in flat_c])
            for rank in range(p):
                for m, g in zip(exp_avgs[rank], grads[rank], strict=True):
                    _update_momentum(m, g, beta2)
            if compression == "1bit":
                delta = brute_force_vote_1bit(flat_c, step, tie_break)
            else:
                delta = brute_force_vote_kbit(
                    flat_c, step, bits, quantizer, aggregation, kbit_algorithm, tie_break, l1_clip, numels, bucket_size
                )
            start = 0
            for t, size in zip(params, numels, strict=True):
                _apply_update(t, delta[start : start + size].reshape(t.shape), step_lr, weight_decay)
                start += size

        if momentum_sync_interval > 0 and step % momentum_sync_interval == 0:
            chosen = range(len(params)) if momentum_sync_params is None else momentum_sync_params
            for i in chosen:
                total = torch.zeros(params[i].shape, dtype=torch.float32)
                for rank in range(p):
                    total += exp_avgs[rank][i].float()
                for rank in range(p):
                    exp_avgs[rank][i].copy_(total / p)

    return params, exp_avgs


# ----------------------------------------------------------------------------------------------
# compressed LionCub under ZeRO-1/2 as a hybrid: shard inside a node, vote across nodes
# ----------------------------------------------------------------------------------------------

HybridGradsFn = Callable[[int, int, int, list[Tensor]], list[Tensor]]


@dataclass
class HybridRun:
    """What every rank of a simulated hybrid job must hold.

    Rank (k, j) = global rank k*G + j holds shard j of every group: elements [j*P_i, (j+1)*P_i) of
    ``masters[i]`` and of its node's momentum ``momenta[k][i]``, with P_i = ``partition_sizes[i]``.

    Attributes:
        params_per_step: the model parameters (the same on every rank) after each engine step.
        masters: per group, the padded flat fp32 master vector; the padding moves too.
        momenta: ``momenta[k][i]``: node k's padded flat momentum of group i.
        lioncub_steps: LionCub's step count after each engine step (a skipped step does not count).
        skipped: per engine step, whether every rank skipped it (a non-finite gradient somewhere).
        partition_sizes: P_i, the shard length of group i.
        node_grad_norms: per engine step, each node's gradient norm before clipping (NaN when skipped
            or when clipping is off).
        feedback: with error feedback, ``feedback[j]``: the EF state of the vote on shard j, its worker k
            being node k (so rank (k, j) holds worker k's residuals or estimates of ``feedback[j]``).
        clip_factors: with ``sketch_clip``, the factor of every step taken.
    """

    params_per_step: list[list[Tensor]]
    masters: list[Tensor]
    momenta: list[list[Tensor]]
    lioncub_steps: list[int]
    skipped: list[bool]
    partition_sizes: list[int]
    node_grad_norms: list[list[float]]
    feedback: list[EfState] = field(default_factory=list)
    clip_factors: list[float] = field(default_factory=list)

    def shard(self, vector: Tensor, group: int, local_index: int) -> Tensor:
        """Shard ``local_index`` of a padded flat vector of ``group``."""
        size = self.partition_sizes[group]
        return vector[local_index * size : (local_index + 1) * size]


def _node_gradient(
    micro_grads: list[list[list[Tensor]]], node: int, node_size: int, accumulate_after_reduce: bool
) -> list[Tensor]:
    """Node ``node``'s gradient from ``micro_grads[rank][micro][param]`` (already divided by the accumulation steps).

    ZeRO's reduction inside the node: every rank's gradient divided by G, then summed in rank order.
    ``accumulate_after_reduce`` False: each rank first sums its micro-batches, the node reduces once;
    True: the node reduces every micro-batch and sums the reduced micro-batches.
    """
    ranks = range(node * node_size, (node + 1) * node_size)
    micros = len(micro_grads[ranks[0]])
    count = len(micro_grads[ranks[0]][0])

    def reduce(per_rank: list[list[Tensor]]) -> list[Tensor]:
        out = []
        for i in range(count):
            total = torch.zeros(per_rank[0][i].shape, dtype=torch.float32)
            for grads in per_rank:
                total += grads[i].float() / node_size
            out.append(total)
        return out

    def accumulate(per_micro: list[list[Tensor]]) -> list[Tensor]:
        out = [per_micro[0][i].float().clone() for i in range(count)]
        for grads in per_micro[1:]:
            for i in range(count):
                out[i] += grads[i].float()
        return out

    if accumulate_after_reduce:
        return accumulate([reduce([micro_grads[r][m] for r in ranks]) for m in range(micros)])
    return reduce([accumulate(micro_grads[r]) for r in ranks])


def _sketched_clip_factor(
    node_grads: list[list[Tensor]],
    groups: list[list[int]],
    groups_padding: Sequence[int],
    node_size: int,
    step: int,
    sketch_clip: tuple[float, int],
) -> float:
    """Option clip's factor under the hybrid: every node's shards sketched (shard j of group i as tensor i, shard
    key j), summed, divided by the node count (:func:`tests.support.clip_reference.brute_force_sketch`)."""
    from tests.support.clip_reference import brute_force_sketch

    max_norm, bins = sketch_clip
    total = torch.zeros(bins, dtype=torch.float64)
    for grads in node_grads:
        for i, (group, pad) in enumerate(zip(groups, groups_padding, strict=True)):
            flat = _flatten_padded([grads[p] for p in group], pad)
            size = flat.numel() // node_size
            for j in range(node_size):
                total += brute_force_sketch([flat[j * size : (j + 1) * size]], bins, step, shard=j, first_tensor=i)
    norm = math.sqrt(float(((total / len(node_grads)) ** 2).sum()))
    return min(1.0, max_norm / (norm + 1e-6))


def _flatten_padded(tensors: list[Tensor], padding: int) -> Tensor:
    """The tensors flattened in order into one fp32 vector with ``padding`` zeros at the end."""
    parts = [t.detach().float().reshape(-1) for t in tensors]
    return torch.cat([*parts, torch.zeros(padding, dtype=torch.float32)])


@torch.no_grad()
def simulate_hybrid(
    init_params: list[Tensor],
    grads_fn: HybridGradsFn,
    nodes: int,
    node_size: int,
    steps: int,
    *,
    groups_padding: Sequence[int],
    param_groups: Sequence[Sequence[int]] | None = None,
    gradient_accumulation_steps: int = 1,
    accumulate_after_reduce: bool = False,
    gradient_clipping: float = 0.0,
    lr: float | Callable[[int], float] = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float | Sequence[float] = 0.0,
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
) -> HybridRun:
    """Simulate compressed LionCub under ZeRO-1/2 on ``nodes`` x ``node_size`` ranks for ``steps`` engine steps.

    The semantics of docs/design.md, section 12 (ZeRO-1/2 hybrid: shard inside a node, vote across nodes),
    written from the definitions with no ds_lioncub or DeepSpeed code.

    Ranks are node-major: node k holds ranks [k*G, (k+1)*G). Per engine step:

    1. every rank's gradient: grads_fn(rank, step, micro, params) is the gradient of one micro-batch's
       loss at the current parameters (which it receives as clones); it is divided by the accumulation
       steps, as DeepSpeed scales the loss;
    2. node k's gradient: the ranks' gradients divided by G and summed in rank order (``_node_gradient``);
    3. a non-finite gradient on any rank skips the step on every rank: nothing moves, LionCub's step
       count stays;
    4. with ``gradient_clipping`` > 0 each node scales its gradient by 1 / max(1, (norm + 1e-6) / clip),
       norm = the L2 norm of the node's gradient over all parameters; with ``sketch_clip`` = (max_norm, K)
       (LionCub's option clip) every node scales it by the factor of tests.support.clip_reference from the
       sketches of every node's shards (shard j of group i sketched as tensor i with shard key j, the nodes'
       sum divided by the node count), recorded in ``clip_factors``;
    5. per param group (``param_groups``: parameter indices in order, default one group of all), the
       gradient is flattened with ``groups_padding[i]`` zeros at the end into the group's padded flat
       vector, whose G equal shards are what ZeRO gives the node's ranks (geometry is an input here);
    6. per node, per element: c = b1*m + (1-b1)*g and m = b2*m + (1-b2)*g with the node's momentum;
    7. the nodes aggregate their c as ranks do at stage 0 (the 1-bit vote, k-bit sign or L1 with vote or
       mean; ``"none"`` is exact Lion and needs one node), with the L1 scale mu taken over each whole
       shard, padding included (summed chunk-wise past ``bucket_size``): vote and quantize per shard;
    8. every copy of the shard applies x = x*(1 - lr*wd) - lr*Delta, padding elements included;
    9. every ``momentum_sync_interval`` LionCub steps the nodes' momenta are replaced by their mean
       (fp32, summed in node order).

    With ``error_feedback`` (k-bit L1), step 7 is error feedback's: the nodes' shards j of group i go
    through the EF simulation of tests.support.error_feedback_reference (``bucket_size`` cutting them into
    buckets) as tensor i of the bucket keys, one group at a time (ZeRO steps each group in its own call),
    with one EF state per shard index j.

    ``lr`` may be a callable of the engine step (a schedule's value at that step); ``weight_decay`` a
    sequence, one per param group.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "none" and nodes != 1:
        raise ValueError("exact Lion under ZeRO has one node (ZeRO shards over the whole world)")
    beta1, beta2 = betas
    groups = [list(range(len(init_params)))] if param_groups is None else [list(g) for g in param_groups]
    if sorted(i for g in groups for i in g) != list(range(len(init_params))):
        raise ValueError(f"param_groups {groups} must hold every parameter index exactly once")
    if len(groups_padding) != len(groups):
        raise ValueError("need one padding per param group")
    decays = [float(weight_decay)] * len(groups) if isinstance(weight_decay, int | float) else list(weight_decay)
    if len(decays) != len(groups):
        raise ValueError("need one weight decay per param group")
    params = [t.detach().float().clone() for t in init_params]
    masters = [_flatten_padded([params[i] for i in g], pad) for g, pad in zip(groups, groups_padding, strict=True)]
    for master in masters:
        if master.numel() % node_size != 0:
            raise ValueError(f"a padded group of {master.numel()} elements does not split into {node_size} shards")
    partition_sizes = [m.numel() // node_size for m in masters]
    momenta = [[torch.zeros_like(m) for m in masters] for _ in range(nodes)]
    world = nodes * node_size
    run = HybridRun([], masters, momenta, [], [], partition_sizes, [])
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
    lioncub_step = 0

    for step in range(1, steps + 1):
        micro_grads = [
            [
                [
                    g.detach().float() * (1.0 / gradient_accumulation_steps)
                    for g in grads_fn(rank, step, micro, [t.clone() for t in params])
                ]
                for micro in range(gradient_accumulation_steps)
            ]
            for rank in range(world)
        ]
        node_grads = [_node_gradient(micro_grads, k, node_size, accumulate_after_reduce) for k in range(nodes)]
        finite = all(bool(torch.isfinite(g).all()) for grads in node_grads for g in grads)
        norms = [math.nan] * nodes
        if not finite:
            run.skipped.append(True)
            run.lioncub_steps.append(lioncub_step)
            run.params_per_step.append([t.clone() for t in params])
            run.node_grad_norms.append(norms)
            continue
        if sketch_clip is not None:
            factor = _sketched_clip_factor(node_grads, groups, groups_padding, node_size, lioncub_step + 1, sketch_clip)
            run.clip_factors.append(factor)
            for grads in node_grads:
                for g in grads:
                    if factor < 1.0:
                        g.mul_(factor)
        if gradient_clipping > 0:
            for k, grads in enumerate(node_grads):
                norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])).float()
                norms[k] = float(norm)
                coefficient = torch.clamp((norm + 1e-6) / gradient_clipping, min=1.0)
                for g in grads:
                    g.mul_(1.0 / coefficient)
        lioncub_step += 1
        step_lr = lr(step) if callable(lr) else lr
        group_c: list[list[Tensor]] = []  # per group, each node's flat c
        for i, (group, pad) in enumerate(zip(groups, groups_padding, strict=True)):
            flat_grads = [_flatten_padded([grads[p] for p in group], pad) for grads in node_grads]
            group_c.append([_pre_sign_update(momenta[k][i], flat_grads[k], beta1) for k in range(nodes)])
            for k in range(nodes):
                _update_momentum(momenta[k][i], flat_grads[k], beta2)
        if error_feedback is not None:
            deltas = _feedback_deltas_by_shard(run, group_c, node_size, lioncub_step, feedback_options)
        else:
            deltas = [
                _vote(
                    flat_c,
                    lioncub_step,
                    compression,
                    bits,
                    quantizer,
                    aggregation,
                    kbit_algorithm,
                    tie_break,
                    l1_clip,
                    [partition_sizes[i]] * node_size,
                    bucket_size,
                )
                for i, flat_c in enumerate(group_c)
            ]
        for i, group in enumerate(groups):
            _apply_update(masters[i], deltas[i], step_lr, decays[i])
            start = 0
            for p in group:
                size = params[p].numel()
                params[p] = masters[i][start : start + size].reshape(params[p].shape).clone()
                start += size
        if momentum_sync_interval > 0 and lioncub_step % momentum_sync_interval == 0:
            for i in range(len(groups)):
                total = torch.zeros_like(masters[i])
                for k in range(nodes):
                    total += momenta[k][i]
                for k in range(nodes):
                    momenta[k][i].copy_(total / nodes)
        run.skipped.append(False)
        run.node_grad_norms.append(norms)
        run.lioncub_steps.append(lioncub_step)
        run.params_per_step.append([t.clone() for t in params])
    return run


def _vote(
    flat_c: list[Tensor],
    step: int,
    compression: str,
    bits: int,
    quantizer: str,
    aggregation: str,
    kbit_algorithm: str,
    tie_break: str,
    l1_clip: float,
    segment_sizes: list[int],
    bucket_size: int,
) -> Tensor:
    """The nodes' aggregated direction of one padded flat group without error feedback (simulate_hybrid, step 7)."""
    if compression == "none":
        return torch.sign(flat_c[0])
    if compression == "1bit":
        return brute_force_vote_1bit(flat_c, step, tie_break)
    return brute_force_vote_kbit(
        flat_c, step, bits, quantizer, aggregation, kbit_algorithm, tie_break, l1_clip, segment_sizes, bucket_size
    )


def _feedback_deltas_by_shard(
    run: HybridRun, group_c: list[list[Tensor]], node_size: int, step: int, options: dict[str, Any]
) -> list[Tensor]:
    """Per group, the padded flat direction with error feedback: shard j of group i comes from the vote of every
    node's shard j of group i (what LionCub steps on rank (k, j) in the group's call, tensor i of its bucket
    keys), through the EF state ``run.feedback[j]``."""
    nodes = len(group_c[0])
    deltas = [torch.empty_like(flat_c[0]) for flat_c in group_c]
    for i, flat_c in enumerate(group_c):
        for j in range(node_size):
            shards = [[run.shard(flat_c[k], i, j)] for k in range(nodes)]
            (delta,) = feedback_deltas(run.feedback[j], shards, step, options, first_key_tensor=i)
            run.shard(deltas[i], i, j).copy_(delta)
    return deltas
