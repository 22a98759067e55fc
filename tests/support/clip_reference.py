"""A plain-loop reference of option ``clip``: the sketched norm of the ranks' mean gradient, from its definition.

Element ``i`` of tensor ``t`` (in the order the ranks step them) goes to bin ``i mod K`` with the sign
``T[(o_t + i) mod P]`` (the table ``T`` and the offsets ``o_t`` are the estimator's definition, taken from
:mod:`ds_lioncub.step.clipping`); here every element is scattered into its bin at once in fp64, the
ranks' sketches are added in rank order, and the factor is DeepSpeed's formula with that estimate. No
rows, chunks or pieces: a bug in how the library walks a tensor cannot hide in a shared helper.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ds_lioncub.step.clipping import SIGN_PERIOD, sign_offset, sign_table

GradsFn = Callable[[int, int, list[Tensor]], list[Tensor]]


def brute_force_sketch(grads: list[Tensor], bins: int, step: int, shard: int = 0, first_tensor: int = 0) -> Tensor:
    """One rank's sketch: every element of ``grads[t]`` (tensor ``first_tensor + t``) scattered into bin ``i mod bins``
    with its sign, in fp64."""
    table = sign_table(torch.device("cpu"))[:SIGN_PERIOD].double()
    sketch = torch.zeros(bins, dtype=torch.float64)
    for t, grad in enumerate(grads):
        index = torch.arange(grad.numel())
        signs = table[(sign_offset(step, first_tensor + t, shard) + index) % SIGN_PERIOD]
        sketch.index_add_(0, index % bins, grad.detach().reshape(-1).cpu().double() * signs)
    return sketch


def plain_sketch_and_squares(
    tensors: list[list[Tensor]], bins: int, step: int, shard: int = 0, first_tensor: int = 0
) -> Tensor:
    """:func:`~ds_lioncub.step.clipping.sketch_and_square_norm` on a CPU from the module's definition of its order,
    one element at a time in Python floats (IEEE doubles): each bin adds ``sign * value`` (the element's fp32 value)
    one element after another, the pieces of a tensor in order, tensor after tensor; K more bins add the squares the
    same way, and the last number is their pairwise fold (zeros up to a power of two ``2h``, then ``s[j] + s[j + h]``
    for ``j < h``, halving ``h`` down to 1)."""
    table = sign_table(torch.device("cpu"))[:SIGN_PERIOD].tolist()
    sums, squares = [0.0] * bins, [0.0] * bins
    for t, pieces in enumerate(tensors):
        offset, i = sign_offset(step, first_tensor + t, shard), 0
        for piece in pieces:
            for value in piece.detach().reshape(-1).float().tolist():
                sums[i % bins] += table[(offset + i) % SIGN_PERIOD] * value
                squares[i % bins] += value * value
                i += 1
    return torch.tensor([*sums, plain_pairwise_fold(squares)], dtype=torch.float64)


def plain_pairwise_fold(values: list[float]) -> float:
    """The pairwise fold of the sketch's squares, in Python floats: zeros pad ``values`` to a power of two ``2h``, then
    ``s[j] + s[j + h]`` for ``j < h``, halving ``h`` down to 1."""
    size = 1
    while size < len(values):
        size *= 2
    folded = values + [0.0] * (size - len(values))
    while len(folded) > 1:
        half = len(folded) // 2
        folded = [folded[j] + folded[j + half] for j in range(half)]
    return folded[0]


def clip_factor(rank_grads: list[list[Tensor]], bins: int, step: int, max_norm: float) -> float:
    """The factor every rank scales its gradients by at ``step``: ``min(1, max_norm / (|mean sketch| + 1e-6))``."""
    total = torch.zeros(bins, dtype=torch.float64)
    for grads in rank_grads:
        total += brute_force_sketch(grads, bins, step)
    norm = math.sqrt(float(((total / len(rank_grads)) ** 2).sum()))
    return min(1.0, max_norm / (norm + 1e-6))


def clipped_grads_fn(grads_fn: GradsFn, world_size: int, max_norm: float, bins: int, factors: list[float]) -> GradsFn:
    """``grads_fn`` with every rank's gradients of a step scaled by the step's :func:`clip_factor` (appended to
    ``factors`` once per step): what a reference simulation of a clipped run feeds its ranks."""
    cache: dict[int, list[list[Tensor]]] = {}

    def clipped(rank: int, step: int, params: list[Tensor]) -> list[Tensor]:
        if step not in cache:
            everyone = [grads_fn(r, step, [p.clone() for p in params]) for r in range(world_size)]
            factor = clip_factor(everyone, bins, step, max_norm)
            factors.append(factor)
            cache[step] = [[g * factor if factor < 1.0 else g for g in grads] for grads in everyone]
        return cache[step][rank]

    return clipped
