"""benchmarks/study_noise_scale.py's arithmetic: B_simple as a ratio of means from a run's recorded terms, and
kappa_eff as the model's inverse, against values worked by hand and the planner's model."""

from __future__ import annotations

import pytest

from benchmarks.study_noise_scale import b_simple_windows, kappa_effective
from ds_lioncub.planner.time_to_loss import model_ratio


def record(squares: list[float | None], traces: list[float | None], windows: int) -> dict[str, object]:
    return {"noise_terms": {"worker_windows": windows, "gradient_square": squares, "trace_per_worker_batch": traces}}


def test_b_simple_is_the_windows_times_the_mean_trace_over_the_mean_square() -> None:
    run = record([4.0, 2.0, None, 6.0], [1.0, 3.0, 9.0, 5.0], windows=4)
    # Steps 0, 1 and 3 (step 2 has no |G|^2): mean trace 3, mean square 4, b = 4 windows: 3 windows.
    assert b_simple_windows(run, 0, 4) == pytest.approx(3.0)
    assert b_simple_windows(run, 1, 2) == pytest.approx(4 * 3.0 / 2.0)
    assert b_simple_windows(record([-1.0], [1.0], 4), 0, 1) is None  # the noise hides the gradient
    assert b_simple_windows({"noise_terms": None}, 0, 1) is None


@pytest.mark.parametrize("kappa", [2 / 3.141592653589793, 0.75, 0.9])
@pytest.mark.parametrize("noise_over_batch", [0.25, 1.0, 4.0])
def test_kappa_effective_inverts_the_planners_model(kappa: float, noise_over_batch: float) -> None:
    r = model_ratio(kappa, 1 / noise_over_batch)
    assert kappa_effective(r, noise_over_batch) == pytest.approx(kappa, rel=1e-12)
    assert kappa_effective(1 / (1 + noise_over_batch), noise_over_batch) is None  # r too small for any kappa
