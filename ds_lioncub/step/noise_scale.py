"""The job's gradient noise scale, measured as it trains (option ``telemetry.noise_scale``).

Why: how much a compressed mode loses to exact Lion in steps depends on the batch against the gradient noise
scale B_noise (docs/user-guide.md, "The gradient noise scale"; McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"). Data parallelism gives two batch sizes for free: each voter's gradient (batch b) and the
voters' mean (batch B = N b). With ``|G_b|^2`` the mean of the voters' squared norms and ``|G_B|^2`` the squared
norm of their mean,

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

are unbiased estimates of the true gradient's squared norm and of the trace of one sample's gradient covariance;
each step's is very noisy, so both are smoothed by a moving average, and B_simple = tr(Sigma) / |G|^2 divides the
averages. In units of one voter's batch (b = 1, B = N) the two read ``(N |G_B|^2 - |G_b|^2) / (N - 1)`` and
``N (|G_b|^2 - |G_B|^2) / (N - 1)``: tr(Sigma), and so B_simple, scale with b and |G|^2 does not, so the state
is kept per voter batch and B_simple is given in samples by multiplying by b when b is known.

The inputs come from option ``clip``'s sketch (:mod:`ds_lioncub.step.clipping`): each rank sends
:func:`~ds_lioncub.step.clipping.sketch_and_square_norm`'s ``bins + 1`` numbers through the one all-reduce of the
step, so the sum holds the sketch of the summed gradient (``|G_B|^2 = |bins / N|^2``, unbiased) and the sum of
the ranks' squared norms (``|G_b|^2 = sum / N``). Under the ZeRO hybrid each rank holds a shard of its node's
averaged gradient and the sum runs over the whole world, so it is the sum of the nodes' squared norms: the voters
are the nodes and b is a node's batch. Every rank (and every worker of the virtual world) holds the same summed
bits, so every one keeps the same estimate.

:class:`NoiseScaleState` is the state (one object, as one hook state in PyTorch's powerSGD); :class:`NoiseScale`
the read-only record it gives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ds_lioncub.errors import LionCubConfigError


def step_estimates(summed: torch.Tensor, voters: int, loss_scale: float = 1.0) -> tuple[float, float] | None:
    """One step's unbiased estimates ``(|G|^2, tr(Sigma) per voter batch)`` from ``summed``, the ranks' summed
    :func:`~ds_lioncub.step.clipping.sketch_and_square_norm` (bins, then the summed squared norms), of gradients
    multiplied by ``loss_scale``; None when a gradient was not finite (the step is then left out)."""
    if voters < 2:
        raise ValueError(f"the noise scale needs two voters or more, got {voters}")
    scale = loss_scale * loss_scale
    small = float(summed[-1]) / voters / scale  # |G_b|^2: the mean of the voters' squared norms
    big = float(torch.linalg.vector_norm(summed[:-1] / voters)) ** 2 / scale  # |G_B|^2: the mean's, sketched
    if not (math.isfinite(small) and math.isfinite(big)):
        return None
    gradient_square = (voters * big - small) / (voters - 1)
    trace = voters * (small - big) / (voters - 1)
    return gradient_square, trace


@dataclass(frozen=True)
class NoiseScale:
    """The smoothed gradient noise scale after ``steps`` measured steps (:attr:`ds_lioncub.LionCub.noise_scale`).

    Attributes:
        steps: steps measured so far (a step whose gradients were not finite is left out).
        voters: N, the voters whose gradients were compared (the ranks at ZeRO stage 0, the nodes under the hybrid).
        batch_samples: b, the samples in one voter's gradient (micro-batch x accumulation steps, x the ranks of a
            node under the hybrid), set by the DeepSpeed wiring or
            :meth:`~ds_lioncub.LionCub.set_noise_scale_batch`; None when not known.
        gradient_square: the smoothed estimate of |G|^2, the true gradient's squared norm.
        trace_per_voter_batch: the smoothed estimate of tr(Sigma) / b, the trace of the covariance of one voter's
            gradient.
        b_simple_voter_batches: B_simple in voter batches (``trace_per_voter_batch / gradient_square``); None while
            the smoothed |G|^2 is not positive (the noise still hides the gradient).
    """

    steps: int
    voters: int
    batch_samples: int | None
    gradient_square: float
    trace_per_voter_batch: float
    b_simple_voter_batches: float | None

    @property
    def trace_sigma(self) -> float | None:
        """tr(Sigma), the trace of one sample's gradient covariance; None when ``batch_samples`` is not known."""
        return None if self.batch_samples is None else self.trace_per_voter_batch * self.batch_samples

    @property
    def b_simple(self) -> float | None:
        """B_simple in samples (compare it with the global batch B = N b); None when ``batch_samples`` is not known
        or the estimate is not defined yet."""
        if self.batch_samples is None or self.b_simple_voter_batches is None:
            return None
        return self.b_simple_voter_batches * self.batch_samples


class NoiseScaleState:
    """The moving averages of |G|^2 and tr(Sigma) (per voter batch), fed one summed sketch per step.

    Both averages are bias-corrected (divided by ``1 - beta**steps``, as Adam's moments are), so the first steps'
    values are not pulled towards 0; their ratio is the same either way.
    """

    def __init__(self, beta: float, batch_samples: int | None = None) -> None:
        self.beta = beta
        self.batch_samples = batch_samples
        self.steps = 0
        self.voters = 0
        self._gradient_square = 0.0
        self._trace = 0.0

    def set_batch_samples(self, samples: int | None) -> None:
        """Say how many samples one voter's gradient averages (None: not known; B_simple then in voter batches)."""
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise LionCubConfigError(
                f"LionCub: the samples per voter batch must be a positive integer (a voter's micro-batch x its "
                f"accumulation steps), got {samples!r}; pass None to report the noise scale in voter batches."
            )
        self.batch_samples = samples

    def update(self, summed: torch.Tensor, voters: int, loss_scale: float = 1.0) -> None:
        """Add one step: ``summed`` is the all-reduced ``bins + 1`` numbers of every rank's
        :func:`~ds_lioncub.step.clipping.sketch_and_square_norm` (gradients multiplied by ``loss_scale``)."""
        estimates = step_estimates(summed, voters, loss_scale)
        if estimates is None:
            return
        gradient_square, trace = estimates
        self._gradient_square = self.beta * self._gradient_square + (1 - self.beta) * gradient_square
        self._trace = self.beta * self._trace + (1 - self.beta) * trace
        self.steps += 1
        self.voters = voters

    def state_dict(self) -> dict[str, float | int]:
        """The moving averages and their counts, for a checkpoint: a resumed run goes on averaging where this one
        stopped (and so reports what an uninterrupted run reports). Not ``beta`` (an option) nor the samples per
        voter batch (the engine's, set again at start)."""
        return {
            "steps": self.steps,
            "voters": self.voters,
            "gradient_square": self._gradient_square,
            "trace": self._trace,
        }

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Take over :meth:`state_dict` of a checkpoint."""
        self.steps = int(state["steps"])
        self.voters = int(state["voters"])
        self._gradient_square = float(state["gradient_square"])
        self._trace = float(state["trace"])

    def record(self) -> NoiseScale | None:
        """The smoothed estimate so far; None before the first measured step."""
        if self.steps == 0:
            return None
        correction = 1 - self.beta**self.steps
        gradient_square = self._gradient_square / correction
        trace = self._trace / correction
        ratio = trace / gradient_square if gradient_square > 0 else None
        return NoiseScale(self.steps, self.voters, self.batch_samples, gradient_square, trace, ratio)


__all__ = ["NoiseScale", "NoiseScaleState", "step_estimates"]
