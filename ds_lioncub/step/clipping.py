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

The order of the sums, on a CPU (:func:`sketch_and_square_norm`): each element's value in fp32 (bf16 and fp16
widen exactly) times its sign is exact; each bin starts at 0 and adds its elements' products in fp64 one
after another, in element order within a tensor (its pieces in order), tensor after tensor. The squared norm
sums the same way: a second row of ``K`` bins adds each element's square (exact in fp64) into bin
``i mod K``, and those ``K`` sums are folded pairwise (zeros pad them to a power of two ``2h``, then
``s[j] + s[j + h]`` for ``j < h``, halving ``h`` to 1; :func:`~ds_lioncub.comm.packing.torch_impl.fold_pairwise`).
Every addition's operands are thus fixed: the compiled kernel (``ops/csrc/cpu``, :func:`ds_lioncub.comm.packing.
sketch_and_squares`, which reads the gradient once, with a bit-packed copy of the table of signs) and its torch
reference (one elementwise add per row of ``K``) give the same bits, whatever the threads or the SIMD width, and
the first use of the kernel checks it against the reference. On a GPU (and any device but the CPU) the sketch
sums as before: passes of :func:`chunk_for` elements, each a product with the fp32 table and a column sum of its
rows into fp64 (whose order is torch's, fixed for one device and shape), the squares by torch's ``sum``; every
rank of a job steps on one kind of device, so all ranks sum in one order.

Every rank adds its own gradient's sketch in fp64, one all-reduce sums them (every transport sums floats
in rank order, so every rank holds the same bits; under the ZeRO hybrid one all-reduce inside the node, then
one across the nodes, :mod:`ds_lioncub.comm.transport.levels`), and every rank computes the same coefficient
``min(1, max_norm / (|S / voters| + 1e-6))`` (DeepSpeed's formula with the estimate in place of the
norm): the ranks' parameters stay bit-identical, and a resumed run draws the same signs (they depend on
the step, not on a generator's state).

:class:`ClipControls` is the option's surface on :class:`~ds_lioncub.optimizer.LionCub` (a base class of it):
the factor of a step, and the factor a caller that steps in parts (the ZeRO hybrids) gives for all its parts. The
same sketch, with each rank's squared norm appended (:func:`sketch_and_square_norm`), feeds the gradient noise
scale (option ``telemetry.noise_scale``, :mod:`ds_lioncub.step.noise_scale`): one sketch and one all-reduce per
step serve both, and the sketch runs on every step where either is on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.comm import packing
from ds_lioncub.comm.transport import CommStats, Summing, Transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.clip_rule import measures_noise_scale, sketch_bins_of
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.bucket_work import Entry
from ds_lioncub.step.noise_scale import NoiseScaleState
from ds_lioncub.step.parts import StepInParts

#: The length of the table of random signs (a prime, so that a table position repeats only after
#: ``sketch_bins * SIGN_PERIOD`` elements of one tensor).
SIGN_PERIOD = 1_048_573
#: Elements added per pass of the column sums (:func:`sketch_in_passes`) on any device but a GPU (bounds the
#: temporaries: one fp32 product of this many elements); a CPU's steps sketch with the kernel instead.
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
_BIT_TABLES: dict[torch.device, torch.Tensor] = {}
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


def sign_bits_table(device: torch.device) -> torch.Tensor:
    """The signs of :func:`sign_table`'s period as bits (uint8, the packing's sign layout: bit ``i`` is 1 where
    ``T[i]`` is +1), ``SIGN_PERIOD + 64`` of them (the last 64 repeat the first: the kernel reads 64 bits at a time
    from any position before the period's end): what the CPU kernel reads, 1/32 of the fp32 table's bytes. Made
    once per device from :func:`sign_table`, so both give the same signs."""
    table = _BIT_TABLES.get(device)
    if table is None:
        period = sign_table(torch.device("cpu"))[:SIGN_PERIOD]
        signs = torch.cat([period, period[:64]])
        table = packing.pack_signs(signs, zero_is_positive=False).to(device, copy=True)
        _BIT_TABLES[device] = table
    return table


def sign_offset(step: int, tensor: int, shard: int) -> int:
    """Where tensor ``tensor``'s element 0 reads the sign table at step ``step`` on shard ``shard``: a 64-bit
    multiply-xorshift mix of the three (any fixed mix would do; it must only spread nearby inputs apart)."""
    x = (step * 0x9E3779B97F4A7C15 + tensor * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % SIGN_PERIOD


def _walk(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, offsets: Sequence[int]
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Every piece of ``tensors``, its first element's bin and its first element's position in the table of signs;
    tensor ``t``'s element 0 is at bin 0 and at ``offsets[t]``."""
    pieces: list[torch.Tensor] = []
    columns: list[int] = []
    starts: list[int] = []
    for offset, tensor_pieces in zip(offsets, tensors, strict=True):
        position = 0
        for piece in tensor_pieces:
            pieces.append(piece)
            columns.append(position % bins)
            starts.append((offset + position) % SIGN_PERIOD)
            position += piece.numel()
    return pieces, columns, starts


def _add_on_cpu(out: torch.Tensor, tensors: Sequence[Sequence[torch.Tensor]], offsets: Sequence[int]) -> None:
    """The CPU's sketch and squares of ``tensors`` added to ``out`` (fp64, bins + 1), in the module's order."""
    pieces, columns, starts = _walk(tensors, out.numel() - 1, offsets)
    packing.sketch_and_squares(pieces, columns, starts, sign_bits_table(out.device), SIGN_PERIOD, out)


def add_to_sketch(sketch: torch.Tensor, pieces: Sequence[torch.Tensor], offset: int) -> None:
    """Add the sketch of one flat tensor, given as consecutive ``pieces``, to ``sketch`` (fp64, K bins) in place.

    Element ``i`` of the concatenation goes to bin ``i mod K`` with sign ``T[(offset + i) mod P]``; each
    product is exact in fp32 (a sign), and each bin's sum is taken in fp64: on a CPU continuing each bin's sum
    one element after another (the module's order), elsewhere by passes of column sums.
    """
    bins = sketch.numel()
    if sketch.device.type == "cpu":
        out = torch.cat([sketch, sketch.new_zeros(1)])
        _add_on_cpu(out, [pieces], [offset])
        sketch.copy_(out[:bins])
    else:
        _add_in_passes(sketch, pieces, offset)


def _add_in_passes(sketch: torch.Tensor, pieces: Sequence[torch.Tensor], offset: int) -> None:
    """:func:`add_to_sketch` by passes of :func:`chunk_for` elements: a product with the fp32 table of signs, then
    a column sum of the pass's rows into fp64 (a partial row added alone)."""
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
    if device.type == "cpu":
        return sketch_and_square_norm(tensors, bins, step, shard, first_tensor)[:bins]
    return sketch_in_passes(tensors, bins, step, shard, first_tensor)


def sketch_in_passes(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """:func:`gradient_sketch` as a device other than the CPU (a GPU) sums it: passes of :func:`chunk_for` elements,
    each a product with the fp32 table of signs and a column sum of its rows into fp64, on any device."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    sketch = torch.zeros(bins, dtype=torch.float64, device=device)
    for t, pieces in enumerate(tensors):
        _add_in_passes(sketch, pieces, sign_offset(step, first_tensor + t, shard))
    return sketch


def sketch_and_square_norm(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """``bins + 1`` fp64 numbers: :func:`gradient_sketch`'s bins, then the rank's squared norm, the sum of the squares
    of every element of ``tensors`` (one all-reduce then sums both over the ranks: the sketch of the summed
    gradient, and the ranks' own squared norms, which the gradient noise scale needs).

    On a CPU one pass of the compiled kernel (or its torch reference) reads each element once for both, in the
    order the module's docstring defines; elsewhere the sketch's passes, then the squares' sums."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    if device.type == "cpu":
        out = torch.zeros(bins + 1, dtype=torch.float64)
        _add_on_cpu(out, tensors, [sign_offset(step, first_tensor + t, shard) for t in range(len(tensors))])
        return out
    sketch = sketch_in_passes(tensors, bins, step, shard, first_tensor)
    squares = torch.zeros(1, dtype=torch.float64, device=sketch.device)
    for pieces in tensors:
        for piece in pieces:
            squares += piece.detach().reshape(-1).double().square().sum()
    return torch.cat([sketch, squares])


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
    #: Whether the caller averages the gradients before the step (then no voter's own gradient is seen).
    gradients_are_averaged: bool
    #: The gradient noise scale's moving averages (option ``telemetry.noise_scale``).
    _noise_scale_state: NoiseScaleState
    #: Whether a caller that steps in parts took this step's sketch already (:meth:`clip_coefficient_given`).
    _sketch_given: bool

    def comm_stats(self) -> CommStats:
        raise NotImplementedError

    @property
    def measures_noise_scale(self) -> bool:
        """Whether the steps measure the gradient noise scale: option ``telemetry.noise_scale``, a compressed mode, two
        voters or more (:func:`~ds_lioncub.step.noise_scale.measures_noise_scale`)."""
        return measures_noise_scale(self.options, self.transport.world_size, self.gradients_are_averaged)

    @property
    def sketches_each_step(self) -> bool:
        """Whether every step sketches the gradients and sums the sketch over the ranks: for option ``clip``, the
        noise scale, or both (one sketch serves both)."""
        return self.options.mean_clip is not None or self.measures_noise_scale

    def sketch_step(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float = 1.0, first_tensor: int = 0
    ) -> float | None:
        """The step's sketch, for a caller that steps in parts (the ZeRO hybrids), before the first part: what
        :meth:`clip_coefficient` does, and the noise scale's update when it is measured; returns option ``clip``'s
        factor, or None when LionCub does not clip. Give the result to :meth:`clip_coefficient_given`.

        A collective over the agreement group, called by every rank when :attr:`sketches_each_step` is true.
        """
        before = self.comm_stats()
        factor = self._sketch(tensors, step, loss_scale, first_tensor)
        # A caller's, before its step: that step's record counts it (:meth:`take_traffic_before_step`).
        self._traffic_before_step = self._traffic_before_step + (self.comm_stats() - before)
        return factor

    def clip_coefficient(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float = 1.0, first_tensor: int = 0
    ) -> float:
        """Option ``clip``'s factor for step ``step``: the sketch of this rank's gradients (``tensors[t]``: the pieces
        of flat tensor ``first_tensor + t``), summed over the ranks by one all-reduce (one per level under the ZeRO
        hybrid), gives the estimated norm of the voters' mean gradient (divided by ``loss_scale``) and
        ``min(1, max_norm / (norm + 1e-6))``.

        A collective: every rank of the agreement group (the voters; under the ZeRO hybrid the whole world, each
        rank with its shard) calls it once per step with the same layout, and all get the same factor
        (:mod:`ds_lioncub.step.clipping`). With the noise scale measured, the same all-reduce updates it.
        """
        if self.options.mean_clip is None:
            raise LionCubSetupError("LionCub: clip_coefficient() needs option clip, e.g. clip={'max_norm': 1.0}.")
        factor = self.sketch_step(tensors, step, loss_scale, first_tensor)
        assert factor is not None
        return factor

    def _sketch(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float, first_tensor: int
    ) -> float | None:
        """One sketch, one all-reduce (whose traffic the current step counts): option ``clip``'s factor (None
        without clip) and the noise scale's update (when measured)."""
        clip = self.options.mean_clip
        bins = sketch_bins_of(self.options)
        noise = self.measures_noise_scale
        # Without the noise scale the all-reduce stays the sketch alone (its bytes as before the noise scale).
        make = sketch_and_square_norm if noise else gradient_sketch
        summed = make(tensors, bins, step, self._clip_shard, first_tensor)
        self._agreement_sum.all_reduce_sum(summed)
        voters = self.transport.world_size
        if noise:
            self._noise_scale_state.update(summed, voters, loss_scale)
        if clip is None:
            return None
        # The bins alone: summed element by element in rank order, the same bits with or without the squares.
        return clip_coefficient(summed[:bins], voters, clip.max_norm, loss_scale)

    @property
    def next_step(self) -> int:
        """The number of the step the next ``step()`` takes (1 for the first)."""
        return self.param_groups[0]["step"] + 1 if self.param_groups else 1

    @contextmanager
    def clip_coefficient_given(self, coefficient: float | None) -> Iterator[None]:
        """Within this block ``step()`` scales the gradients by ``coefficient`` instead of computing option ``clip``'s
        (None: LionCub does not clip), and takes the step's sketch as taken.

        For callers that step in parts (DeepSpeed's ZeRO under the hybrid steps one flat shard per call), which
        sketch once over every part with :meth:`sketch_step` (or :meth:`clip_coefficient`) before the first.
        """
        self._given_clip_coefficient = coefficient
        self._sketch_given = True
        try:
            yield
        finally:
            self._given_clip_coefficient = None
            self._sketch_given = False

    def take_traffic_before_step(self) -> CommStats:
        """What was sent for a step that never ran (option clip's all-reduce before a step DeepSpeed then skipped),
        for that step's record; it no longer counts toward the next step."""
        traffic, self._traffic_before_step = self._traffic_before_step, CommStats()
        return traffic

    def _clip_gradients(self, entries: list[Entry], step: int) -> None:
        """The step's sketch (:attr:`sketches_each_step`): option ``clip`` scales every participating gradient in
        place by the step's factor; the noise scale takes its update from the same all-reduce."""
        coefficient = self._given_clip_coefficient
        if not self._sketch_given:
            in_parts = self._parts is not None or self._first_key_tensor != 0
            if in_parts and self.options.mean_clip is None:
                # The noise scale alone: a part is not the whole gradient and no caller sketched the whole step, so
                # this step is not measured (every rank steps in the same parts, so every rank skips it alike).
                return
            if in_parts:
                raise LionCubSetupError(
                    "LionCub: option clip needs the whole step's gradients at once, but this step() is one part of a "
                    "step and no caller gave the factor (clip_coefficient_given). Under DeepSpeed's ZeRO only the "
                    "hybrid (a compressed mode) supports clip; with compression 'none' use DeepSpeed's "
                    "gradient_clipping."
                )
            coefficient = self._sketch([[entry.grad] for entry in entries], step, 1.0, 0)
        if coefficient is None:
            return
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
    "sign_bits_table",
    "sign_table",
    "sketch_and_square_norm",
    "sketch_in_passes",
]
