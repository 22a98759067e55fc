"""The two-sided 95% Student-t interval of a mean over a few per-seed values.

The convergence study (benchmarks/study_report.py) summarises each cell's per-seed gaps to exact Lion
with it, and the planner's convergence rule (:mod:`ds_lioncub.planner.convergence`) reads it back:
over n values the interval is mean ± t x sd / sqrt(n), sd the sample standard deviation (ddof 1) and t
the 0.975 quantile of Student's t with n - 1 degrees of freedom (4.303 for 3 seeds). No scipy: the
quantile comes from the t distribution's closed-form CDF for whole degrees of freedom.

The CDF: with t = sqrt(df) tan(theta), the t density times dt is proportional to cos(theta)^(df - 1)
d(theta), so P(|T| < t) = R_m(theta), the integral of cos^m over [0, theta] divided by its integral over
[0, pi/2], m = df - 1. Integrating by parts gives R_m = R_(m-2) + cos^(m-1) sin / ((m - 1) W_(m-2)), with
W_m the integral of cos^m over [0, pi/2] = (m - 1) / m W_(m-2), from R_0 = 2 theta / pi (W_0 = pi/2)
and R_1 = sin theta (W_1 = 1): a finite sum, exact to rounding. The quantile is found by bisection on
it. tests/unit/test_student_t.py checks it against a numerical integral of the density.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

#: The interval's coverage: two-sided, so t is the (1 + CONFIDENCE) / 2 = 0.975 quantile.
CONFIDENCE = 0.95


def central_probability(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` (a whole number >= 1) degrees of freedom; ``t`` >= 0."""
    if df < 1 or t < 0:
        raise ValueError(f"central_probability needs df >= 1 and t >= 0, got df={df}, t={t}")
    theta = math.atan(t / math.sqrt(df))
    cos, sin = math.cos(theta), math.sin(theta)
    m = df - 1
    # The base of the recurrence: m even starts from R_0, odd from R_1.
    if m % 2 == 0:
        probability, w_below, power = 2.0 * theta / math.pi, math.pi / 2.0, 2
    else:
        probability, w_below, power = sin, 1.0, 3
    for k in range(power, m + 1, 2):  # k takes m's parity: R_k from R_(k-2)
        probability += cos ** (k - 1) * sin / ((k - 1) * w_below)
        w_below *= (k - 1) / k
    return min(probability, 1.0)


@cache
def t_quantile(df: int) -> float:
    """t with P(|T| < t) = :data:`CONFIDENCE` for ``df`` degrees of freedom: 12.706 at 1, 4.303 at 2, 1.96 as df
    grows. Bisection down to adjacent floats; the CDF takes O(df) steps, so it is meant for counts of seeds."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}")
    low, high = 0.0, 2.0
    while central_probability(high, df) < CONFIDENCE:
        low, high = high, 2.0 * high
    while (middle := 0.5 * (low + high)) not in (low, high):
        if central_probability(middle, df) < CONFIDENCE:
            low = middle
        else:
            high = middle
    return high


def sample_sd(values: Sequence[float]) -> float:
    """The sample standard deviation (ddof 1) of two or more values."""
    if len(values) < 2:
        raise ValueError("sample_sd needs at least two values")
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def half_width_of(sd: float, n: int) -> float | None:
    """The interval's half-width, t(n - 1) x ``sd`` / sqrt(n), for a mean of ``n`` values of sample sd ``sd``;
    None for n < 2 (one value has no spread to go by)."""
    if n < 2:
        return None
    return t_quantile(n - 1) * sd / math.sqrt(n)


@dataclass(frozen=True)
class MeanInterval:
    """A quantity over seeds: its mean and the 95% Student-t interval of the mean.

    Fields:
        values: the per-seed values, in seed order.
        mean: their mean.
        half_width: t(n - 1) x sample sd / sqrt(n); None with one value.
    """

    values: tuple[float, ...]
    mean: float
    half_width: float | None

    @property
    def real(self) -> bool:
        """Whether the interval excludes 0 (a gap shown, not seed noise); never with one value."""
        return self.half_width is not None and abs(self.mean) > self.half_width

    def text(self, digits: int = 2) -> str:
        """``"+1.23 ± 0.45"`` (``"+1.23 ± n/a"`` with one value)."""
        half_width = "n/a" if self.half_width is None else f"{self.half_width:.{digits}f}"
        return f"{self.mean:+.{digits}f} ± {half_width}"


def mean_interval(values: Sequence[float]) -> MeanInterval:
    """The mean of ``values`` (one or more) and its 95% Student-t half-width."""
    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = sum(values) / len(values)
    half_width = half_width_of(sample_sd(values), len(values)) if len(values) > 1 else None
    return MeanInterval(tuple(values), mean, half_width)


__all__ = [
    "CONFIDENCE",
    "MeanInterval",
    "central_probability",
    "half_width_of",
    "mean_interval",
    "sample_sd",
    "t_quantile",
]
