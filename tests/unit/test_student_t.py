"""ds_lioncub/quantities/student_t.py: the 95% Student-t quantile and the interval of a mean, against references
computed here another way: the t density integrated numerically, the closed forms at 1 and 2 degrees of freedom,
and the normal quantile's expansion for many."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from ds_lioncub.quantities.student_t import central_probability, half_width_of, mean_interval, sample_sd, t_quantile


def density(x: float, df: int) -> float:
    """Student's t density with ``df`` degrees of freedom."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def central_mass(t: float, df: int, intervals: int = 4000) -> float:
    """P(|T| < t) by composite Simpson's rule on the density over [0, t], doubled."""
    h = t / intervals
    total = density(0.0, df) + density(t, df)
    total += sum((4 if i % 2 else 2) * density(i * h, df) for i in range(1, intervals))
    return 2.0 * total * h / 3.0


@pytest.mark.parametrize("df", [*range(1, 31), 40, 60, 120])
def test_the_quantile_leaves_95_percent_of_the_density_between_its_two_signs(df: int) -> None:
    t = t_quantile(df)
    assert central_mass(t, df) == pytest.approx(0.95, abs=1e-9)
    # and the CDF it is found on agrees with the integral away from the quantile too
    assert central_probability(0.5 * t, df) == pytest.approx(central_mass(0.5 * t, df), abs=1e-9)


def test_the_closed_forms_at_one_and_two_degrees_of_freedom() -> None:
    # df 1 (Cauchy): P(|T| < t) = 2 atan(t) / pi; df 2: t / sqrt(2 + t^2).
    assert t_quantile(1) == pytest.approx(math.tan(0.95 * math.pi / 2), rel=1e-13)
    assert t_quantile(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-13)
    # The printed tables' three decimals.
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 20: 2.086, 30: 2.042}
    assert {df: round(t_quantile(df), 3) for df in table} == table


@pytest.mark.parametrize("df", [200, 1000])
def test_many_degrees_of_freedom_approach_the_normal_quantile_as_its_expansion_says(df: int) -> None:
    z = NormalDist().inv_cdf(0.975)
    # The first three terms of t's expansion in 1/df around z; the next is below 1e-9 from df 200.
    expansion = z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    expansion += (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    assert t_quantile(df) == pytest.approx(expansion, abs=1e-8)


def test_the_interval_of_a_mean_over_three_seeds() -> None:
    # 5, 4, 6: mean 5, deviations 0, -1, 1, sample variance 1; t(2) = 0.95 sqrt(2 / (1 - 0.95^2)) = 4.3027.
    summary = mean_interval([5.0, 4.0, 6.0])
    t2 = 0.95 * math.sqrt(2 / (1 - 0.95**2))
    assert summary.mean == pytest.approx(5.0) and summary.values == (5.0, 4.0, 6.0)
    assert summary.half_width == pytest.approx(t2 / math.sqrt(3))  # 2.484
    assert summary.real and summary.text() == "+5.00 ± 2.48"
    # 1, 2, 3, 4: sd sqrt(5/3), t(3) = 3.1824 (the table's 3.182)
    assert mean_interval([1.0, 2.0, 3.0, 4.0]).half_width == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, rel=1e-6)
    assert not mean_interval([1.0, -1.0, 3.0]).real  # mean 1, half-width 4.97: the interval holds 0


def test_one_value_has_no_interval() -> None:
    single = mean_interval([3.0])
    assert single.half_width is None and not single.real and single.text() == "+3.00 ± n/a"
    assert half_width_of(1.0, 1) is None
    assert half_width_of(2.0, 2) == pytest.approx(math.tan(0.95 * math.pi / 2) * 2.0 / math.sqrt(2))
    with pytest.raises(ValueError):
        mean_interval([])
    with pytest.raises(ValueError):
        sample_sd([1.0])
    with pytest.raises(ValueError):
        t_quantile(0)
