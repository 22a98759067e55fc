"""Time to exact Lion's loss: how many of exact Lion's steps a mode needs (r), by measurement or by model.

The planner and ``compression="auto"`` rank the candidates by step time x r, the time to reach the loss that
exact Lion reaches (:func:`ds_lioncub.planner.convergence.choose`). r comes from:

- **the model** (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): the steps to a given
  loss scale as S = S_min (1 + B_noise / B). A mode worth a share kappa of the batch (exact Lion on kappa B
  loses what the mode loses after a fixed number of steps: the study's batch share,
  benchmarks/study_batch_share.py) then needs

      r(kappa, B / B_noise) = (1 + B_noise / (kappa B)) / (1 + B_noise / B)

  times exact Lion's steps (:func:`model_ratio`): 1/kappa while B << B_noise, 1 once B >> B_noise. kappa's
  interval gives r's (r falls as kappa grows). B is the job's global batch and B_noise its gradient noise scale,
  both in samples (LionCub measures B_simple as it trains: ``LionCub.noise_scale``, docs/user-guide.md "The
  gradient noise scale");
- **the worst case**, 1/kappa (:func:`worst_case_ratio`), the model's limit of a batch far below the noise
  scale, where the job's noise scale is not known;
- **a measurement** (benchmarks/study_time_to_loss.py: the run length at which the mode's validation loss equals
  exact Lion's after T steps), which takes precedence over the batch share wherever the evidence records the
  noise scale the study ran at: at the job's B / B_noise when it is the study's (within
  :data:`SAME_BATCH_TOLERANCE`), r as measured; at another B / B_noise, the model with the kappa that gives the
  measured r at the study's (:func:`kappa_from_ratio`, "kappa_eff": the study's batch sweep found it about the
  same at every batch, docs/user-guide.md "What a mode costs in steps"); where the job's noise scale is not
  known, that kappa's worst case. A measured r below 1 (the mode beat exact Lion in steps) gives a kappa above 1,
  and r stays below 1 at every batch. Without the study's noise scale the measurement is printed beside the
  batch share's figure, as a check of it.

Exact Lion has r = 1 by definition. A mode with neither kappa nor a measurement has no r: it is ranked by its
step time alone (r taken as 1), and the output says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Where the job's B / B_noise and the study's differ by less than this (relative), a measured r is used.
SAME_BATCH_TOLERANCE = 0.05


def model_ratio(kappa: float, batch_over_noise: float) -> float:
    """r = (1 + 1 / (kappa x)) / (1 + 1 / x), x = B / B_noise: the steps a mode worth ``kappa`` of the batch
    needs, in units of exact Lion's, to reach the same loss. A batch share comes out in (0, 1]; a kappa measured
    through r (:func:`kappa_from_ratio`) may exceed 1 (r < 1), up to infinity (r = x / (1 + x))."""
    if not kappa > 0:
        raise ValueError(f"kappa must be positive, got {kappa}")
    if not batch_over_noise > 0:
        raise ValueError(f"B / B_noise must be positive, got {batch_over_noise}")
    return (1 + 1 / (kappa * batch_over_noise)) / (1 + 1 / batch_over_noise)


def worst_case_ratio(kappa: float) -> float:
    """:func:`model_ratio`'s largest value over every batch: 1/kappa (as B / B_noise -> 0) for kappa <= 1; 1 (as
    B / B_noise -> infinity) for a kappa above 1."""
    if not kappa > 0:
        raise ValueError(f"kappa must be positive, got {kappa}")
    return max(1.0, 1 / kappa)


def kappa_from_ratio(ratio: float, batch_over_noise: float) -> float:
    """The kappa at which :func:`model_ratio` gives ``ratio`` at x = B / B_noise: 1 / (r (1 + x) - x); infinity
    where r (1 + x) - x <= 0 (an r at or below x / (1 + x), which no finite kappa gives)."""
    if not ratio > 0:
        raise ValueError(f"r must be positive, got {ratio}")
    if not batch_over_noise > 0:
        raise ValueError(f"B / B_noise must be positive, got {batch_over_noise}")
    denominator = ratio * (1 + batch_over_noise) - batch_over_noise
    return 1 / denominator if denominator > 0 else math.inf


@dataclass(frozen=True)
class Kappa:
    """The share of the batch a mode is worth, from its study cell (benchmarks/study_evidence.py).

    Attributes:
        value: kappa at the cell's mean gap.
        low, high: at the upper and lower ends of the gap's 95% interval (None without an interval).
        extrapolated: the gap (or an end of its interval) lies beyond the smallest share measured, where the
            share curve is continued as gap = a + c / share.
    """

    value: float
    low: float | None = None
    high: float | None = None
    extrapolated: bool = False

    def text(self, name: str = "kappa") -> str:
        """``"kappa 0.78 [0.70, 0.87]"``, with ``", extrapolated"`` where it is."""
        interval = "" if self.low is None or self.high is None else f" [{self.low:.2f}, {self.high:.2f}]"
        return f"{name} {self.value:.2f}{interval}" + (", extrapolated" if self.extrapolated else "")


@dataclass(frozen=True)
class MeasuredRatio:
    """r measured at the study's batch: mean and 95% Student-t half-width over the bracketed seeds.

    Attributes:
        value, half_width, seeds: the mean, its half-width (None with one seed) and the seeds it is over.
        batch_samples: the study's global batch, in its samples (64-byte windows).
        noise_scale_samples: the study's noise scale B_simple in the same samples, where the evidence records it;
            without it the job's B / B_noise cannot be matched to the study's.
    """

    value: float
    half_width: float | None
    seeds: int
    batch_samples: int | None = None
    noise_scale_samples: float | None = None

    def text(self) -> str:
        """``"1.057 ± 0.017 (4 seeds)"``."""
        spread = "" if self.half_width is None else f" ± {self.half_width:.3f}"
        return f"{self.value:.3f}{spread} ({self.seeds} seed{'s' if self.seeds != 1 else ''})"


@dataclass(frozen=True)
class JobBatch:
    """The job's global batch and gradient noise scale, in samples (None: not given), and its compute per step: the
    seconds of its forward and backward passes, the same in every mode (0: not given; the time to exact Lion's loss
    is then the communication and optimizer's alone). A mode that needs r times exact Lion's steps pays the compute
    r times too."""

    global_batch: float | None = None
    noise_scale: float | None = None
    compute_seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        """B / B_noise, or None unless both are known."""
        if self.global_batch is None or self.noise_scale is None:
            return None
        return self.global_batch / self.noise_scale


@dataclass(frozen=True)
class StepsRatio:
    """r for one candidate, and where it came from.

    Attributes:
        value: r (1 where unknown: the candidate is ranked by its step time alone).
        low, high: r's 95% interval (None where there is none).
        basis: "exact", "measured", "model", "worst case" or "unknown".
        note: how it was found, in words.
    """

    value: float
    low: float | None
    high: float | None
    basis: str
    note: str

    @property
    def known(self) -> bool:
        return self.basis != "unknown"

    def text(self) -> str:
        """``"1.28 [1.15, 1.43]"``; ``"1"`` for exact Lion; ``"?"`` where unknown."""
        if self.basis == "exact":
            return "1"
        if not self.known:
            return "?"
        interval = "" if self.low is None or self.high is None else f" [{self.low:.2f}, {self.high:.2f}]"
        return f"{self.value:.2f}{interval}"


EXACT = StepsRatio(1.0, 1.0, 1.0, "exact", "exact Lion")


def _study_ratio(measured: MeasuredRatio) -> float | None:
    if measured.batch_samples is None or not measured.noise_scale_samples:
        return None
    return measured.batch_samples / measured.noise_scale_samples


def _positive(value: float | None) -> float | None:
    """An end of kappa's interval, or None where it is not above 0 (r then has no upper end)."""
    return value if value is not None and value > 0 else None


def _from_kappa(kappa: Kappa, job: JobBatch, source: str = "") -> StepsRatio:
    """r from ``kappa`` for ``job``; ``source`` (where kappa came from, e.g. r measured) ends the note, and names
    kappa "kappa_eff"."""
    ratio = job.ratio
    kappa_low, kappa_high = _positive(kappa.low), _positive(kappa.high)
    named = kappa.text("kappa_eff" if source else "kappa") + source
    if ratio is None:
        high = None if kappa_low is None else worst_case_ratio(kappa_low)
        low = None if kappa_high is None else worst_case_ratio(kappa_high)
        worst = "worst case 1/kappa" if kappa.value <= 1 else "worst case 1 (r < 1 at every batch)"
        note = f"{worst} (the job's noise scale unknown), {named}"
        return StepsRatio(worst_case_ratio(kappa.value), low, high, "worst case", note)
    high = None if kappa_low is None else model_ratio(kappa_low, ratio)
    low = None if kappa_high is None else model_ratio(kappa_high, ratio)
    note = f"model at B/B_noise = {ratio:.3g}, {named}"
    return StepsRatio(model_ratio(kappa.value, ratio), low, high, "model", note)


def _from_measured(measured: MeasuredRatio, study: float, job: JobBatch, where: str) -> StepsRatio:
    """r at ``job`` from r measured at the study's B / B_noise ``study``, through its kappa_eff."""
    spread = measured.half_width
    kappa = Kappa(
        kappa_from_ratio(measured.value, study),
        None if spread is None else kappa_from_ratio(measured.value + spread, study),
        None if spread is None or measured.value - spread <= 0 else kappa_from_ratio(measured.value - spread, study),
    )
    source = f" from r measured at the study's B/B_noise = {study:.3g}: {measured.text()}{where}"
    return _from_kappa(kappa, job, source)


def steps_ratio(kappa: Kappa | None, measured: MeasuredRatio | None, job: JobBatch, where: str = "") -> StepsRatio:
    """r for a compressed mode with study cell figures ``kappa`` and ``measured`` (either may be None) for a job
    ``job``; ``where`` (e.g. ``" at 32 workers, beta2 0.99"``) is added to the note's measured figure."""
    study = None if measured is None else _study_ratio(measured)
    if measured is not None and study is not None:
        if job.ratio is not None and math.isclose(job.ratio, study, rel_tol=SAME_BATCH_TOLERANCE):
            spread = measured.half_width
            low, high = (None, None) if spread is None else (measured.value - spread, measured.value + spread)
            note = f"measured at the study's batch (B/B_noise = {study:.3g}): {measured.text()}{where}"
            return StepsRatio(measured.value, low, high, "measured", note)
        return _from_measured(measured, study, job, where)
    check = "" if measured is None else f"; measured at the study's batch: {measured.text()}{where}"
    if kappa is None:
        return StepsRatio(1.0, None, None, "unknown", f"no batch share for this mode: r unknown{check}")
    found = _from_kappa(kappa, job)
    return StepsRatio(found.value, found.low, found.high, found.basis, found.note + check)


__all__ = [
    "EXACT",
    "SAME_BATCH_TOLERANCE",
    "JobBatch",
    "Kappa",
    "MeasuredRatio",
    "StepsRatio",
    "kappa_from_ratio",
    "model_ratio",
    "steps_ratio",
    "worst_case_ratio",
]
