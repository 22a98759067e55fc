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

:class:`ClipState` is the option's state on one rank (a part of its :class:`~ds_lioncub.step.rank_step.RankStep`):
the factor of a step, and the factor a caller that steps in parts (the ZeRO hybrids) gives for all its parts. The
same sketch, with each rank's squared norm appended (:func:`sketch_and_square_norm`), feeds the gradient noise
scale (option ``telemetry.noise_scale``, :mod:`ds_lioncub.step.noise_scale`): one sketch and one all-reduce per
step serve both, and the sketch runs on every step where either is on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport import CommStats
from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.clip_rule import measures_noise_scale, sketch_bins_of
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.bucket_work import Entry, non_finite_parameters
from ds_lioncub.step.noise_scale import NoiseScaleState
from ds_lioncub.step.rounds import run_rounds
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
from ds_lioncub.step.wiring import Wiring

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


class ClipState:
    """Option ``clip`` and the gradient noise scale on one rank: the step's sketch, its factor, the factor a caller
    that steps in parts (the ZeRO hybrids) gives for all its parts, and the noise scale's moving averages."""

    def __init__(self, options: LionCubConfig, wiring: Wiring) -> None:
        self.options = options
        self.wiring = wiring
        #: The gradient noise scale's moving averages (option ``telemetry.noise_scale``), fed by the sketch.
        self.noise_scale = NoiseScaleState(options.telemetry.noise_scale_beta)
        #: The factor option ``clip`` scaled the last step's gradients by (1: not clipped); None without clip.
        self.last_coefficient: float | None = None
        # The factor a caller that steps in parts computed for the whole step (clip_coefficient_given), and whether
        # it took this step's sketch already.
        self._given_coefficient: float | None = None
        self._sketch_given = False
        # The traffic of collectives a caller issued for the next step before calling it (sketch_step).
        self.traffic_before_step = CommStats()

    @property
    def measures_noise_scale(self) -> bool:
        """Whether the steps measure the gradient noise scale: option ``telemetry.noise_scale``, a compressed mode, two
        voters or more (:func:`~ds_lioncub.config.clip_rule.measures_noise_scale`)."""
        wiring = self.wiring
        return measures_noise_scale(self.options, wiring.transport.world_size, wiring.gradients_are_averaged)

    @property
    def sketches_each_step(self) -> bool:
        """Whether every step sketches the gradients and sums the sketch over the ranks: for option ``clip``, the
        noise scale, or both (one sketch serves both)."""
        return self.options.mean_clip is not None or self.measures_noise_scale

    def sketch_step(
        self,
        tensors: Sequence[Sequence[torch.Tensor]],
        step: int,
        comm_stats: Callable[[], CommStats],
        loss_scale: float = 1.0,
        first_tensor: int = 0,
    ) -> float | None:
        """The step's sketch taken before the step (:meth:`~ds_lioncub.step.engine_side.EngineSide.sketch_step`), its
        traffic counted for that step (``comm_stats``: the rank's traffic so far); option ``clip``'s factor, or None."""
        before = comm_stats()
        factor, _ = run_rounds(self.sketch_rounds(tensors, step, loss_scale, first_tensor))
        self.traffic_before_step = self.traffic_before_step + (comm_stats() - before)
        return factor

    def sketch_rounds(
        self,
        tensors: Sequence[Sequence[torch.Tensor]],
        step: int,
        loss_scale: float,
        first_tensor: int,
        non_finite_here: bool | None = None,
    ) -> Generator[None, None, tuple[float | None, int | None]]:
        """One sketch, one all-reduce (a round): option ``clip``'s factor (None without clip), the noise scale's
        update (when measured) and, given ``non_finite_here`` (whether this rank's gradient holds a NaN or inf), how
        many ranks' gradients do: the non-finite check's verdict, carried by the same all-reduce (None when not
        given)."""
        clip = self.options.mean_clip
        bins = sketch_bins_of(self.options)
        noise = self.measures_noise_scale
        # Without the noise scale the all-reduce stays the sketch alone (its bytes as before the noise scale).
        make = sketch_and_square_norm if noise else gradient_sketch
        summed = make(tensors, bins, step, self.wiring.clip_shard, first_tensor)
        if non_finite_here is not None:
            # A value of its own, 1 on a rank whose gradient is not finite: its sum counts those ranks exactly, where
            # the non-finite bins would say only that some rank has one. It saves the check its own collective round.
            summed = torch.cat([summed, summed.new_full((1,), 1.0 if non_finite_here else 0.0)])
        self.wiring.agreement_sum.all_reduce_sum(summed)
        yield
        ranks_not_finite = None
        if non_finite_here is not None:
            ranks_not_finite, summed = int(summed[-1].item()), summed[:-1]  # a sum of 0s and 1s: exact
        voters = self.wiring.transport.world_size
        if noise:
            self.noise_scale.update(summed, voters, loss_scale)
        if clip is None:
            return None, ranks_not_finite
        # The bins alone: summed element by element in rank order, the same bits with or without the squares.
        return clip_coefficient(summed[:bins], voters, clip.max_norm, loss_scale), ranks_not_finite

    @contextmanager
    def coefficient_given(self, coefficient: float | None) -> Iterator[None]:
        """Within this block the step scales the gradients by ``coefficient`` instead of computing option ``clip``'s
        (None: no clipping), and takes the step's sketch as taken."""
        self._given_coefficient = coefficient
        self._sketch_given = True
        try:
            yield
        finally:
            self._given_coefficient = None
            self._sketch_given = False

    def take_traffic_before_step(self) -> CommStats:
        """What was sent for the next step before it ran; it no longer counts toward the next step."""
        traffic, self.traffic_before_step = self.traffic_before_step, CommStats()
        return traffic

    def step_sketch_rounds(
        self, entries: list[Entry], step: int, in_parts: bool, carry_finite_check: bool = False
    ) -> Generator[None, None, int | None]:
        """The step's sketch (:attr:`sketches_each_step`): option ``clip`` scales every participating gradient in
        place by the step's factor; the noise scale takes its update from the same all-reduce.

        ``in_parts``: this step() is one part of a step (the whole gradient is not here). ``carry_finite_check``:
        the step's path runs the agreed non-finite check, whose verdict the sketch's all-reduce then carries;
        returns how many ranks have a non-finite gradient (checked before the scaling), for the path to raise on
        without a collective of its own. None: this call carried no verdict (not asked, or no sketch here: a caller
        that steps in parts took it)."""
        coefficient = self._given_coefficient
        ranks_not_finite = None
        if not self._sketch_given:
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
            coefficient, ranks_not_finite = yield from self.sketch_rounds(grads, step, 1.0, 0, non_finite_here)
        if coefficient is not None:
            if coefficient < 1.0:
                torch._foreach_mul_([entry.grad for entry in entries], coefficient)
            self.last_coefficient = coefficient
        return ranks_not_finite


__all__ = [
    "CHUNK",
    "CUDA_CHUNK",
    "ClipState",
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
