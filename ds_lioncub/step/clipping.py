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
in rank order, so every rank holds the same bits; under the ZeRO hybrid one all-reduce inside the node, then
one across the nodes, :mod:`ds_lioncub.comm.transport.levels`), and every rank computes the same coefficient
``min(1, max_norm / (|S / voters| + 1e-6))`` (DeepSpeed's formula with the estimate in place of the
norm): the ranks' parameters stay bit-identical, and a resumed run draws the same signs (they depend on
the step, not on a generator's state).

:class:`ClipControls` is the option's surface on :class:`~ds_lioncub.optimizer.LionCub` (a base class of it):
the factor of a step, and the factor a caller that steps in parts (the ZeRO hybrids) gives for all its parts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport import CommStats, Summing, Transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.bucket_work import Entry
from ds_lioncub.step.parts import StepInParts

#: The length of the table of random signs (a prime, so that a table position repeats only after
#: ``sketch_bins * SIGN_PERIOD`` elements of one tensor).
SIGN_PERIOD = 1_048_573
#: Elements added per pass on a CPU (bounds the temporaries: one fp32 product of this many elements).
CHUNK = 1 << 20
#: Elements added per pass on a GPU: 1,024 rows of the default 4,093 bins. A pass's column sum of 256 rows keeps
#: too few of a GPU's threads busy; 1,024 rows take the sketch of 256 Mi elements from 3.2 to 0.65 Lion updates
#: on an H200 (benchmarks/RESULTS.md, "Option clip", its local cost), for a table of 21 MB and a 17 MB product.
CUDA_CHUNK = 1 << 22
#: The seed of the table of signs: part of the estimator, the same on every rank and in every version.
SIGN_SEED = 0x5EC7C11
#: DeepSpeed's guard against a zero norm in its clipping coefficient.
NORM_EPSILON = 1e-6

_TABLES: dict[torch.device, torch.Tensor] = {}
_MASK64 = (1 << 64) - 1


def chunk_for(device: torch.device) -> int:
    """Elements per pass on ``device``: :data:`CUDA_CHUNK` on a GPU, else :data:`CHUNK`. Every rank of a job
    steps on one kind of device, so every rank sums its bins in the same order."""
    return CUDA_CHUNK if device.type == "cuda" else CHUNK


def sign_table(device: torch.device) -> torch.Tensor:
    """±1 in fp32, ``T[i mod SIGN_PERIOD]`` for ``i < SIGN_PERIOD + chunk_for(device)`` (so that any chunk-long
    window starting before SIGN_PERIOD is one slice), drawn once per device from :data:`SIGN_SEED` on the CPU."""
    table = _TABLES.get(device)
    if table is None:
        generator = torch.Generator().manual_seed(SIGN_SEED)
        period = torch.randint(0, 2, (SIGN_PERIOD,), generator=generator, dtype=torch.int8).float().mul_(2).sub_(1)
        chunk = chunk_for(device)
        table = torch.cat([period, period.repeat(chunk // SIGN_PERIOD + 1)])
        table = table[: SIGN_PERIOD + chunk].to(device, copy=True)  # not a view of the longer cat
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
    chunk = chunk_for(sketch.device)
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
                rows = min(max(1, chunk // bins), left // bins)
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


def clip_shard_of(process_group: dist.ProcessGroup | None) -> int:
    """Which signs the sketch draws on a rank voting over ``process_group``: the group's lowest global rank. The
    voters of one shard share it; under the ZeRO hybrid each shard's voters have their own."""
    return 0 if process_group is None else min(dist.get_process_group_ranks(process_group))


class ClipControls:
    """:class:`~ds_lioncub.optimizer.LionCub`'s surface of option ``clip`` (a base class of LionCub: the attributes
    below are LionCub's)."""

    options: LionCubConfig
    transport: Transport
    param_groups: list[dict[str, Any]]
    _agreement_sum: Summing
    _parts: StepInParts | None
    _first_key_tensor: int
    #: Which shard's signs this rank's sketch draws (:func:`clip_shard_of`).
    _clip_shard: int
    #: The factor a caller that steps in parts computed for the whole step (:meth:`clip_coefficient_given`).
    _given_clip_coefficient: float | None
    #: The traffic of collectives a caller issued for the next step before it (:meth:`clip_coefficient`).
    _traffic_before_step: CommStats
    #: The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip.
    last_clip_coefficient: float | None

    def comm_stats(self) -> CommStats:
        raise NotImplementedError

    def clip_coefficient(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float = 1.0, first_tensor: int = 0
    ) -> float:
        """Option ``clip``'s factor for step ``step``: the sketch of this rank's gradients (``tensors[t]``: the pieces
        of flat tensor ``first_tensor + t``), summed over the ranks by one all-reduce (one per level under the ZeRO
        hybrid), gives the estimated norm of the voters' mean gradient (divided by ``loss_scale``) and
        ``min(1, max_norm / (norm + 1e-6))``.

        A collective: every rank of the agreement group (the voters; under the ZeRO hybrid the whole world, each
        rank with its shard) calls it once per step with the same layout, and all get the same factor
        (:mod:`ds_lioncub.step.clipping`).
        """
        before = self.comm_stats()
        factor = self._sketched_factor(tensors, step, loss_scale, first_tensor)
        # A caller's, before its step: that step's record counts it (:meth:`take_traffic_before_step`).
        self._traffic_before_step = self._traffic_before_step + (self.comm_stats() - before)
        return factor

    def _sketched_factor(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float, first_tensor: int
    ) -> float:
        """:meth:`clip_coefficient`'s sketch, all-reduce and factor, whose traffic the current step counts."""
        clip = self.options.clip
        if clip is None:
            raise LionCubSetupError("LionCub: clip_coefficient() needs option clip, e.g. clip={'max_norm': 1.0}.")
        sketch = gradient_sketch(tensors, clip.sketch_bins, step, self._clip_shard, first_tensor)
        self._agreement_sum.all_reduce_sum(sketch)
        return clip_coefficient(sketch, self.transport.world_size, clip.max_norm, loss_scale)

    @property
    def next_step(self) -> int:
        """The number of the step the next ``step()`` takes (1 for the first)."""
        return self.param_groups[0]["step"] + 1 if self.param_groups else 1

    @contextmanager
    def clip_coefficient_given(self, coefficient: float) -> Iterator[None]:
        """Within this block ``step()`` scales the gradients by ``coefficient`` instead of computing option ``clip``'s.

        For callers that step in parts (DeepSpeed's ZeRO under the hybrid steps one flat shard per call), which
        compute the factor once over every part with :meth:`clip_coefficient` before the first.
        """
        self._given_clip_coefficient = coefficient
        try:
            yield
        finally:
            self._given_clip_coefficient = None

    def take_traffic_before_step(self) -> CommStats:
        """What was sent for a step that never ran (option clip's all-reduce before a step DeepSpeed then skipped),
        for that step's record; it no longer counts toward the next step."""
        traffic, self._traffic_before_step = self._traffic_before_step, CommStats()
        return traffic

    def _clip_gradients(self, entries: list[Entry], step: int) -> None:
        """Option ``clip``: scale every participating gradient in place by the step's factor."""
        coefficient = self._given_clip_coefficient
        if coefficient is None:
            if self._parts is not None or self._first_key_tensor:
                raise LionCubSetupError(
                    "LionCub: option clip needs the whole step's gradients at once, but this step() is one part of a "
                    "step and no caller gave the factor (clip_coefficient_given). Under DeepSpeed's ZeRO only the "
                    "hybrid (a compressed mode) supports clip; with compression 'none' use DeepSpeed's "
                    "gradient_clipping."
                )
            coefficient = self._sketched_factor([[entry.grad] for entry in entries], step, 1.0, 0)
        if coefficient < 1.0:
            torch._foreach_mul_([entry.grad for entry in entries], coefficient)
        self.last_clip_coefficient = coefficient


__all__ = [
    "CHUNK",
    "CUDA_CHUNK",
    "ClipControls",
    "NORM_EPSILON",
    "SIGN_PERIOD",
    "add_to_sketch",
    "clip_coefficient",
    "clip_shard_of",
    "gradient_sketch",
    "sign_offset",
    "sign_table",
]
