"""Clipping by the norm of the ranks' mean gradient, estimated from a sketch (option ``clip``).

Why: exact Lion clips the ranks' mean gradient by its norm. With compression every rank keeps its own
gradient and never forms the mean, so DeepSpeed's ``gradient_clipping`` scales each rank's gradient by a
factor from the ranks' *own* norms, which with few samples per rank are several times the norm of the
mean: it clips on far more steps, by far more, and that alone costs the 1-bit vote more than half of its
gap to exact Lion at 64 workers (benchmarks/RESULTS.md, "Where the gap comes from"). The norm of the mean
can be estimated without the mean: a sketch is linear, so the sum of the ranks' sketches is the sketch
of the summed gradient, one all-reduce of ``sketch_bins`` numbers per step.

The sketch (a CountSketch with a structured hash): element ``i`` of tensor ``t`` is added to bin
``i mod K`` with the sign ``T[(o + i) mod P]``, where ``T`` is a fixed table of random signs of prime
length :data:`SIGN_PERIOD` and ``o`` (:func:`sign_offset`) mixes the step, ``t`` and the rank's shard, so
that the signs change from step to step and between tensors. Then ``E[|S|^2] = |g|^2`` for any gradient
``g``: two elements in one bin meet with independent signs (unless their table positions coincide, which
needs ``K * P`` elements between them inside a tensor), and the relative error of ``|S|^2`` is about
``sqrt(2 / K)`` when no bin holds a large share of the norm. A prime ``K`` (the default 4093) keeps the
columns of a matrix whose rows are a power of two long from all landing in one bin.

Every rank adds its own gradient's sketch in fp64, one all-reduce sums them (every transport sums floats
in rank order, so every rank holds the same bits), and every rank computes the same coefficient
``min(1, max_norm / (|S / voters| + 1e-6))`` (DeepSpeed's formula with the estimate in place of the
norm): the ranks' parameters stay bit-identical, and a resumed run draws the same signs (they depend on
the step, not on a generator's state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: The length of the table of random signs (a prime, so that a table position repeats only after
#: ``sketch_bins * SIGN_PERIOD`` elements of one tensor).
SIGN_PERIOD = 1_048_573
#: Elements added per pass (bounds the temporaries: one fp32 product of this many elements).
CHUNK = 1 << 20
#: The seed of the table of signs: part of the estimator, the same on every rank and in every version.
SIGN_SEED = 0x5EC7C11
#: DeepSpeed's guard against a zero norm in its clipping coefficient.
NORM_EPSILON = 1e-6

_TABLES: dict[torch.device, torch.Tensor] = {}
_MASK64 = (1 << 64) - 1


def sign_table(device: torch.device) -> torch.Tensor:
    """±1 in fp32, ``T[i mod SIGN_PERIOD]`` for ``i < SIGN_PERIOD + CHUNK`` (so that any CHUNK-long window
    starting before SIGN_PERIOD is one slice), drawn once per device from :data:`SIGN_SEED` on the CPU."""
    table = _TABLES.get(device)
    if table is None:
        generator = torch.Generator().manual_seed(SIGN_SEED)
        period = torch.randint(0, 2, (SIGN_PERIOD,), generator=generator, dtype=torch.int8).float().mul_(2).sub_(1)
        table = torch.cat([period, period[:CHUNK]]).to(device)
        _TABLES[device] = table
    return table


def sign_offset(step: int, tensor: int, shard: int) -> int:
    """Where tensor ``tensor``'s element 0 reads the sign table at step ``step`` on shard ``shard``: a 64-bit
    multiply-xorshift mix of the three (any fixed mix would do; it must only spread nearby inputs apart)."""
    x = (step * 0x9E3779B97F4A7C15 + tensor * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % SIGN_PERIOD


def add_to_sketch(sketch: torch.Tensor, pieces: Sequence[torch.Tensor], offset: int) -> None:
    """Add the sketch of one flat tensor, given as consecutive ``pieces``, to ``sketch`` (fp64, K bins) in place.

    Element ``i`` of the concatenation goes to bin ``i mod K`` with sign ``T[(offset + i) mod P]``; each
    product is exact in fp32 (a sign), and each bin's sum is taken in fp64.
    """
    bins = sketch.numel()
    table = sign_table(sketch.device)
    position = 0
    for piece in pieces:
        flat = piece.detach().reshape(-1)
        done = 0
        while done < flat.numel():
            column = position % bins
            left = flat.numel() - done
            if column or left < bins:  # up to the next row start, or the last partial row
                length = min(bins - column, left)
                rows = 1
            else:
                rows = min(max(1, CHUNK // bins), left // bins)
                length = rows * bins
            start = (offset + position) % SIGN_PERIOD
            values = flat[done : done + length].float() * table[start : start + length]
            if rows == 1 and length < bins:
                sketch[column : column + length] += values.double()
            else:
                sketch += values.view(rows, bins).sum(0, dtype=torch.float64)
            done += length
            position += length


def gradient_sketch(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """The fp64 sketch (``bins`` bins) of a rank's gradients: ``tensors[t]`` holds the pieces of flat tensor
    ``first_tensor + t`` (one piece for a parameter's gradient, several for a ZeRO partition's)."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    sketch = torch.zeros(bins, dtype=torch.float64, device=device)
    for t, pieces in enumerate(tensors):
        add_to_sketch(sketch, pieces, sign_offset(step, first_tensor + t, shard))
    return sketch


def clip_coefficient(summed_sketch: torch.Tensor, voters: int, max_norm: float, loss_scale: float = 1.0) -> float:
    """``min(1, max_norm / (|summed_sketch / voters| / loss_scale + 1e-6))``; 1 when the estimate is not finite
    (a NaN or inf gradient, which the non-finite check or the caller's overflow check then handles)."""
    norm = float(torch.linalg.vector_norm(summed_sketch / voters)) / loss_scale
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + NORM_EPSILON))


__all__ = [
    "CHUNK",
    "NORM_EPSILON",
    "SIGN_PERIOD",
    "add_to_sketch",
    "clip_coefficient",
    "gradient_sketch",
    "sign_offset",
    "sign_table",
]
