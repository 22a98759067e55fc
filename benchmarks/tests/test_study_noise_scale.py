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


def test_the_planners_r_is_carried_from_the_anchors_measurement_and_set_beside_each_batchs() -> None:
    """At the anchor (64 windows, B_simple 32: x = 2), r 1.06 ± 0.025 measured; elsewhere the planner's r is the
    model's through the kappa that gives 1.06 at x = 2: 1 / (1.06 x 3 - 2) = 0.847, at 16 windows (x = 0.5)
    (1 + 1 / (0.847 x 0.5)) / 3 = 1.121."""
    from benchmarks.study_noise_scale import BatchPoint, planner_table
    from ds_lioncub.quantities.student_t import mean_interval

    def point(batch: int, b_simple: float, ratios: list[float]) -> BatchPoint:
        return BatchPoint("d", batch, mean_interval([b_simple] * 2), [], mean_interval(ratios), len(ratios), 2)

    anchor = point(64, 32.0, [1.05, 1.06, 1.07])
    far = point(16, 32.0, [1.30, 1.31, 1.32])  # measured far above the planner's figure: "no"
    text = planner_table([point(16, 32.0, [1.10, 1.12, 1.14]), anchor, far], anchor)
    lines = text.splitlines()[2:]
    kappa = 1 / (1.06 * 3 - 2)
    assert f"{(1 + 1 / (kappa * 0.5)) / 3:.2f}" in lines[0] and lines[0].endswith("| model | yes |")
    assert "| 1.06 [" in lines[1] and lines[1].endswith("| measured | yes |")
    assert lines[2].endswith("| model | no |")
