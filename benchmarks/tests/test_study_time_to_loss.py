"""benchmarks/study_time_to_loss.py: r, the steps to exact Lion's loss in units of T, on runs written here with
losses chosen so that every crossing is worked out by hand below, and on the shipped pilot's runs against the
per-seed r that benchmarks/RESULTS.md reports ("Time to Lion's loss: a first measurement")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import study_time_to_loss
from benchmarks.study_batch_share import extrapolated_share
from benchmarks.study_grid import RESULTS, config_dir
from benchmarks.study_time_to_loss import kappa_check, run_lengths, seed_ratios, summary
from ds_lioncub.simulate.time_to_loss import crossing

FIRST_LOSS = 5.5


def write_run(
    root: Path, steps: int, mode: str, workers: int, seed: int, val: float, design: str = "lr5e-4", first: float = 5.5
) -> None:
    directory = config_dir(root, "small", steps, design)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"workers": workers, "mode": mode, "beta2": 0.99, "seed": seed, "val_loss": val}
    record["train_losses"] = [first, first - 0.5]
    (directory / f"N{workers:02d}_{mode}_b2-0.99_seed{seed}.json").write_text(json.dumps(record))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """32 workers; exact Lion's loss after 300 steps is 2.0 for every seed. The vote's losses by length:

    - seed 0: 2.10 at 300, 1.90 at 375: the target halfway, 337.5 steps, r = 1.125;
    - seed 1: 2.20, 2.05, 1.95 at 300, 375, 450: between 375 and 450, halfway, 412.5 steps, r = 1.375;
    - seed 2: 1.99 at 300, 1.80 at 375, already below: on the line through them, 300 - 75 x 0.01 / 0.19 steps;
    - seed 3: 2.30, 2.20, 2.10, 2.05 at 300-600: never reaches it, r > 2;
    - seed 4: trained on other data (its first loss differs from exact Lion's): left out;
    - seed 5: one length only: nothing to interpolate between.
    A 1,000-step run (another schedule family) is not a length by default.
    """
    for seed in range(6):
        write_run(tmp_path, 300, "exact", 32, seed, 2.0)
    losses = {0: [2.10, 1.90], 1: [2.20, 2.05, 1.95], 2: [1.99, 1.80], 3: [2.30, 2.20, 2.10, 2.05], 5: [2.1]}
    for seed, values in losses.items():
        for steps, val in zip((300, 375, 450, 600), values, strict=False):
            write_run(tmp_path, steps, "1bit_sketchclip", 32, seed, val)
    write_run(tmp_path, 300, "1bit_sketchclip", 32, 4, 2.10, first=5.4)
    write_run(tmp_path, 375, "1bit_sketchclip", 32, 4, 1.90, first=5.4)
    write_run(tmp_path, 1000, "1bit_sketchclip", 32, 0, 1.0)
    return tmp_path


def test_the_crossing_is_linear_between_the_two_lengths_around_it() -> None:
    assert crossing([(300, 2.1), (375, 1.9)], 2.0) == (pytest.approx(337.5), "", 0)
    assert crossing([(450, 1.95), (300, 2.2), (375, 2.05)], 2.0)[0] == pytest.approx(375 + 75 * 0.05 / 0.10)
    # Already below at the shortest run: on the line through the two shortest, below it.
    assert crossing([(300, 1.99), (375, 1.8)], 2.0) == (pytest.approx(300 - 75 * 0.01 / 0.19), "<=", 300)
    assert crossing([(300, 1.99), (375, 1.99)], 2.0) == (None, "<=", 300)  # a line that does not fall
    assert crossing([(300, 2.3), (600, 2.05)], 2.0) == (None, ">", 600)
    # Exactly at the target at a measured length: that length.
    assert crossing([(300, 2.1), (375, 2.0), (450, 1.9)], 2.0)[0] == pytest.approx(375.0)


def test_the_lengths_are_t_times_the_issues_multiples_that_exist(root: Path) -> None:
    assert run_lengths(root, "small", 300, "lr5e-4") == [300, 375, 450, 600]
    assert run_lengths(root, "small", 300, "lr5e-4", [300, 1000]) == [300, 1000]


def test_each_seed_is_interpolated_by_hand_or_named_where_not_bracketed(root: Path) -> None:
    ratios = {s.seed: s for s in seed_ratios(root, "small", 300, "lr5e-4", 32, "1bit_sketchclip", 0.99)}
    assert set(ratios) == {0, 1, 2, 3}  # seed 4 on other data, seed 5 with one length
    assert ratios[0].r == pytest.approx(337.5 / 300)
    assert ratios[1].r == pytest.approx(412.5 / 300)
    assert ratios[2].r == pytest.approx((300 - 75 * 0.01 / 0.19) / 300) and ratios[2].extrapolated
    assert not ratios[0].extrapolated
    assert (ratios[3].r, ratios[3].bound) == (None, "> 2.00")


def test_the_summary_is_the_mean_of_the_bracketed_seeds_with_its_t_interval(root: Path) -> None:
    found = summary(root, "small", 300, "lr5e-4", 32, "1bit_sketchclip", 0.99)
    assert found.interval is not None
    values = [1.125, 1.375, (300 - 75 * 0.01 / 0.19) / 300]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    t2 = 4.302652729911275  # the 0.975 quantile of Student's t with 2 degrees of freedom
    assert found.interval.mean == pytest.approx(mean)
    assert found.interval.half_width == pytest.approx(t2 * sd / math.sqrt(3))
    assert [s.seed for s in found.unbracketed] == [3]
    text = "\n".join(study_time_to_loss.table(root, "small", 300, "lr5e-4", [32], ["1bit_sketchclip"], [0.99]))
    assert f"| 1bit_sketchclip | 32 | 0.99 | {mean:.3f} ± {t2 * sd / math.sqrt(3):.3f} | 3 |" in text
    assert f"2: {values[2]:.3f}*" in text
    assert "| 3: r > 2.00 |" in text
    assert "run lengths 300, 375, 450, 600;" in text


def test_the_share_beyond_the_curve_follows_one_over_the_share() -> None:
    curve = [(0.625, 3.6), (0.875, 1.0)]
    # Inside: linear, as study_batch_share's table reads it.
    assert extrapolated_share(2.3, curve) == (pytest.approx(0.625 + 0.25 * 1.3 / 2.6), False)
    assert extrapolated_share(-0.5, curve) == (1.0, False)  # no loss: the whole batch, at most
    # Beyond: gap = a + c / s through (0.625, 3.6) and (0.875, 1.0): c = 2.6 / (1.6 - 8/7), a = 3.6 - 1.6 c.
    c = 2.6 / (1 / 0.625 - 1 / 0.875)
    a = 3.6 - c / 0.625
    share, extrapolated = extrapolated_share(6.0, curve)  # type: ignore[misc]
    assert extrapolated and share == pytest.approx(c / (6.0 - a))
    assert extrapolated_share(2.0, []) is None  # no curve
    assert extrapolated_share(5.0, [(0.625, 3.6), (0.875, 4.0)]) is None  # a curve that does not fall with the share


def test_one_over_kappa_comes_from_the_gap_through_the_share_curve(root: Path) -> None:
    # Exact Lion on 40 and 56 of 64 windows at 8 workers: gaps +4% and +1% (seed 0). The vote at 32 workers in the
    # whole batch, seed 0: 2.05 against 2.0, +2.5%: share 0.625 + 0.25 x (4 - 2.5) / 3 = 0.75, 1/kappa 4/3.
    write_run(root, 300, "exact", 8, 0, 2.0)
    write_run(root, 300, "exact", 8, 0, 2.08, design="lr5e-4_batch40")
    write_run(root, 300, "exact", 8, 0, 2.02, design="lr5e-4_batch56")
    write_run(root, 300, "1bit", 32, 0, 2.05)
    check = kappa_check(root, "small", 300, 32, "1bit", 0.99)
    assert check is not None and check.gap.half_width is None
    assert check.inverse == pytest.approx(1 / 0.75) and not check.extrapolated
    assert (check.low, check.high) == (None, None)  # one seed: no interval


def test_the_pilots_runs_give_the_pilots_r() -> None:
    """benchmarks/RESULTS.md's pilot table, r per seed for the 1-bit vote with clip at 32 workers, beta2 0.99:
    1.042, 1.057, 1.059, 1.069 (seeds 0-3), r = 1.057 ± 0.018."""
    ratios = {s.seed: s.r for s in seed_ratios(RESULTS, "small", 300, "lr5e-4", 32, "1bit_sketchclip", 0.99)}
    pilot = {0: 1.042, 1: 1.057, 2: 1.059, 3: 1.069}
    assert {seed: round(ratios[seed], 3) for seed in pilot} == pilot  # type: ignore[arg-type]
    rounded = list(pilot.values())
    mean = sum(rounded) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in rounded) / 3)
    assert (round(mean, 3), round(3.182 * sd / 2, 3)) == (1.057, 0.018)  # t(3) = 3.182
