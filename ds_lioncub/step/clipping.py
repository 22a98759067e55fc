"""Clipping by the norm of the ranks' mean gradient, estimated from a sketch (option ``clip``).

Why: exact Lion clips the ranks' mean gradient by its norm. With compression every rank keeps its own
gradient and never forms the mean, so DeepSpeed's ``gradient_clipping`` scales each rank's gradient by a
factor from the ranks' *own* norms, which with few samples per rank are several times the norm of the
mean: it clips on far more steps, by far more, and that alone costs the 1-bit vote more than half of its
gap to exact Lion at 64 workers (benchmarks/RESULTS.md, "Where the gap comes from"). The norm of the mean
can be estimated without the mean: a sketch is linear, so the sum of the ranks' sketches is the sketch
of the summed gradient, one all-reduce of ``sketch_bins`` numbers per step.

The sketch itself, its signs and the order of its sums, is :mod:`ds_lioncub.step.sketch`.

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

from ds_lioncub.comm.transport import CommStats, Summing, Transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.clip_rule import measures_noise_scale, sketch_bins_of
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.bucket_work import Entry, non_finite_parameters
from ds_lioncub.step.noise_scale import NoiseScaleState
from ds_lioncub.step.parts import StepInParts
from ds_lioncub.step.sketch import (  # re-exported: the sketch lived here until it got its own module
    CHUNK,
    CUDA_CHUNK,
    SIGN_PERIOD,
    SIGN_SEED,
    add_to_sketch,
    chunk_for,
    gradient_sketch,
    sign_bits_table,
    sign_offset,
    sign_table,
    sketch_and_square_norm,
    sketch_in_passes,
)

#: DeepSpeed's guard against a zero norm in its clipping coefficient.
NORM_EPSILON = 1e-6


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
        factor, _ = self._sketch(tensors, step, loss_scale, first_tensor)
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
        self,
        tensors: Sequence[Sequence[torch.Tensor]],
        step: int,
        loss_scale: float,
        first_tensor: int,
        non_finite_here: bool | None = None,
    ) -> tuple[float | None, int | None]:
        """One sketch, one all-reduce (whose traffic the current step counts): option ``clip``'s factor (None
        without clip), the noise scale's update (when measured) and, given ``non_finite_here`` (whether this rank's
        gradient holds a NaN or inf), how many ranks' gradients do: the non-finite check's verdict, carried by the
        same all-reduce (None when not given)."""
        clip = self.options.mean_clip
        bins = sketch_bins_of(self.options)
        noise = self.measures_noise_scale
        # Without the noise scale the all-reduce stays the sketch alone (its bytes as before the noise scale).
        make = sketch_and_square_norm if noise else gradient_sketch
        summed = make(tensors, bins, step, self._clip_shard, first_tensor)
        if non_finite_here is not None:
            # A value of its own, 1 on a rank whose gradient is not finite: its sum counts those ranks exactly, where
            # the non-finite bins would say only that some rank has one. It saves the check its own collective round.
            summed = torch.cat([summed, summed.new_full((1,), 1.0 if non_finite_here else 0.0)])
        self._agreement_sum.all_reduce_sum(summed)
        ranks_not_finite = None
        if non_finite_here is not None:
            ranks_not_finite, summed = int(summed[-1].item()), summed[:-1]  # a sum of 0s and 1s: exact
        voters = self.transport.world_size
        if noise:
            self._noise_scale_state.update(summed, voters, loss_scale)
        if clip is None:
            return None, ranks_not_finite
        # The bins alone: summed element by element in rank order, the same bits with or without the squares.
        return clip_coefficient(summed[:bins], voters, clip.max_norm, loss_scale), ranks_not_finite

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

    def _clip_gradients(self, entries: list[Entry], step: int, carry_finite_check: bool = False) -> int | None:
        """The step's sketch (:attr:`sketches_each_step`): option ``clip`` scales every participating gradient in
        place by the step's factor; the noise scale takes its update from the same all-reduce.

        ``carry_finite_check``: the step's path runs the agreed non-finite check
        (:func:`~ds_lioncub.step.paths.require_finite_gradients`), whose verdict the sketch's all-reduce then
        carries; returns how many ranks have a non-finite gradient (checked before the scaling), for the path to
        raise on without a collective of its own. None: this call carried no verdict (not asked, or no sketch
        here: a caller that steps in parts took it)."""
        coefficient = self._given_clip_coefficient
        ranks_not_finite = None
        if not self._sketch_given:
            in_parts = self._parts is not None or self._first_key_tensor != 0
            if in_parts and self.options.mean_clip is None:
                # The noise scale alone: a part is not the whole gradient and no caller sketched the whole step, so
                # this step is not measured (every rank steps in the same parts, so every rank skips it alike).
                return None
            if in_parts:
                raise LionCubSetupError(
                    "LionCub: option clip needs the whole step's gradients at once, but this step() is one part of a "
                    "step and no caller gave the factor (clip_coefficient_given). Under DeepSpeed's ZeRO only the "
                    "hybrid (a compressed mode) supports clip; with compression 'none' use DeepSpeed's "
                    "gradient_clipping."
                )
            non_finite_here = bool(non_finite_parameters(entries)) if carry_finite_check else None
            grads = [[entry.grad] for entry in entries]
            coefficient, ranks_not_finite = self._sketch(grads, step, 1.0, 0, non_finite_here)
        if coefficient is not None:
            if coefficient < 1.0:
                torch._foreach_mul_([entry.grad for entry in entries], coefficient)
            self.last_clip_coefficient = coefficient
        return ranks_not_finite


__all__ = [
    "CHUNK",
    "CUDA_CHUNK",
    "ClipControls",
    "NORM_EPSILON",
    "SIGN_PERIOD",
    "SIGN_SEED",
    "add_to_sketch",
    "chunk_for",
    "clip_coefficient",
    "clip_shard_of",
    "gradient_sketch",
    "sign_offset",
    "sign_bits_table",
    "sign_table",
    "sketch_and_square_norm",
    "sketch_in_passes",
]
