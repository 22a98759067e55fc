"""The scripts that read the convergence study's runs: the pairing with exact Lion they share
(benchmarks/study_report.py's pair_with_exact), study_designs' seeds for a +-1 point interval and its
paired table, study_drift's windowed persistence and drift ratio, and study_horizon's gap per window of
training. Every expected value is worked out by hand below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.study_designs import design_rows, seeds_for
from benchmarks.study_drift import rows, windowed
from benchmarks.study_grid import clip_of_run, config_dir, mode_options
from benchmarks.study_horizon import rows as horizon_rows
from benchmarks.study_horizon import window_gaps
from benchmarks.study_report import pair_with_exact, paired
from ds_lioncub.simulate.drift import TensorDrift, WindowDrift


def write_run(directory: Path, mode: str, seed: int, val: float, first_loss: float = 5.5, **more: Any) -> None:
    record = {"workers": 64, "mode": mode, "beta2": 0.99, "seed": seed, "val_loss": val, **more}
    record["train_losses"] = [first_loss, first_loss - 0.5]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"N64_{mode}_b2-0.99_seed{seed}.json").write_text(json.dumps(record))


def test_a_run_pairs_with_exact_lions_of_its_seed_and_never_across_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, "exact", 0, 2.0)
    write_run(tmp_path, "exact", 1, 2.0, first_loss=5.6)
    run = {"workers": 64, "beta2": 0.99, "seed": 0, "val_loss": 2.1, "train_losses": [5.5, 5.0]}
    pair = pair_with_exact(tmp_path, run)
    assert pair is not None
    exact, gap = pair
    assert exact["seed"] == 0 and exact["mode"] == "exact"
    assert gap == pytest.approx(5.0)  # 100 x (2.1 - 2.0) / 2.0
    assert capsys.readouterr().err == ""
    # Seed 1's exact run started from another loss: another task, refused with a warning.
    other = {**run, "seed": 1, "candidate": "vote"}
    assert pair_with_exact(tmp_path, other) is None
    warning = capsys.readouterr().err
    assert "vote" in warning and "N64_exact_b2-0.99_seed1.json" in warning and "other data" in warning
    # No exact run of seed 2: no pair, nothing to warn about.
    assert pair_with_exact(tmp_path, {**run, "seed": 2}) is None
    assert capsys.readouterr().err == ""


def test_seeds_for_a_one_point_half_width() -> None:
    # The 0.975 quantiles of Student's t (printed tables): t(2) 4.303, t(3) 3.182, t(5) 2.571, t(6) 2.447,
    # t(16) 2.120, t(17) 2.110.
    # sd 1: t(5) / sqrt 6 = 2.571 / 2.449 > 1 and t(6) / sqrt 7 = 2.447 / 2.646 < 1, so 7 seeds.
    assert 2.571 / 6**0.5 > 1 > 2.447 / 7**0.5
    assert seeds_for(1.0) == 7
    # sd 0.5: 0.5 t(2) / sqrt 3 = 1.24 > 1, 0.5 t(3) / sqrt 4 = 0.80 <= 1: 4 seeds.
    assert 0.5 * 4.303 / 3**0.5 > 1 >= 0.5 * 3.182 / 4**0.5
    assert seeds_for(0.5) == 4
    # sd 2: 2 t(16) / sqrt 17 = 1.028 > 1, 2 t(17) / sqrt 18 = 0.995 <= 1: 18 seeds.
    assert 2 * 2.120 / 17**0.5 > 1 >= 2 * 2.110 / 18**0.5
    assert seeds_for(2.0) == 18
    # Only the ratio sd / goal matters; no spread needs the fewest seeds an sd has; too many is None.
    assert seeds_for(2.0, goal=2.0) == 7
    assert seeds_for(0.0) == 2
    assert seeds_for(2.0, most=17) is None


def test_the_designs_table_pairs_by_seed_leaves_out_other_data_and_sums_wall_time(tmp_path: Path) -> None:
    directory = config_dir(tmp_path, "small", 300)
    for seed, (exact, mode, wide_exact, wide_mode) in {2: (2.0, 2.1, 4.0, 4.4), 10: (1.0, 1.04, 2.0, 2.02)}.items():
        write_run(directory, "exact", seed, exact, val_loss_wide=wide_exact, wall_s=100.0 * seed)
        write_run(directory, "1bit", seed, mode, val_loss_wide=wide_mode, wall_s=10.0 * seed)
    write_run(directory, "exact", 1, 2.0, val_loss_wide=4.0, wall_s=1.0)
    write_run(directory, "1bit", 1, 3.0, first_loss=5.0, val_loss_wide=6.0, wall_s=1.0)  # on other data
    pairs = paired(directory, 64, 0.99, "1bit")
    assert [run["seed"] for run, _, _ in pairs] == [2, 10]  # by seed, not by file name
    assert [gap for _, _, gap in pairs] == pytest.approx([5.0, 4.0])
    row = design_rows(tmp_path, "small", 300, 64, 0.99, "1bit")[4]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "base" and cells[2] == "2" and cells[3] == "+5.0, +4.0"
    # sd of (5, 4): sqrt(0.5) = 0.71; wide gaps 10 and 1, sd sqrt(40.5) = 6.36;
    # wall s per pair: ((200 + 20) + (1000 + 100)) / 2 = 660.
    assert cells[5] == "0.71" and cells[7] == "6.36" and cells[9] == "660"


def test_windowed_persistence_and_drift_ratio_sum_only_the_last_windows() -> None:
    windows = (WindowDrift(100, 50, 200), WindowDrift(40, 10, 100), WindowDrift(30, 20, 60), WindowDrift(10, 0, 40))
    drift = TensorDrift("w", numel=10, steps=200, flips=999, flip_runs=3, windows=(*windows, WindowDrift(20, 5, 0)))
    # Last 3: drift 20 + 0 + 5 = 25 over err 30 + 10 + 20 = 60, over exact 60 + 40 + 0 = 100.
    assert windowed(drift, 3) == pytest.approx((25 / 60, 25 / 100))
    # All 5: drift 85 over err 200, over exact 400.
    assert windowed(drift) == pytest.approx((85 / 200, 85 / 400))
    assert windowed(drift, 9) == pytest.approx((85 / 200, 85 / 400))  # fewer windows than asked: all of them
    quiet = TensorDrift("q", numel=1, steps=50, flips=0, flip_runs=0, windows=(WindowDrift(0, 0, 0),))
    assert windowed(quiet, 3) == (0.0, 0.0)


def _tensor(name: str, numel: int, flips: int, flip_runs: int, windows: list[tuple[int, int, int]]) -> dict[str, Any]:
    return {
        "name": name,
        "numel": numel,
        "steps": 200,
        "flips": flips,
        "flip_runs": flip_runs,
        "windows": [{"err_l1": e, "drift_l1": d, "exact_l1": x} for e, d, x in windows],
    }


def test_the_drift_table_sets_whole_run_flips_beside_windowed_persistence(tmp_path: Path) -> None:
    a = _tensor("a", 6, 30, 20, [(10, 4, 20), (6, 3, 10), (8, 2, 16), (4, 4, 8)])
    b = _tensor("b", 4, 12, 5, [(2, 2, 4), (2, 0, 4), (0, 0, 0), (4, 2, 8)])
    write_run(tmp_path, "exact", 0, 2.0)
    write_run(tmp_path, "1bit", 0, 2.2, drift=[a, b])
    lines = rows(tmp_path, 64, "1bit", [0.99])
    assert "flip rate (whole run)" in lines[2] and "last 3" in lines[2]
    # Whole model: flips 42 over 10 elements x 200 steps = 0.021; 25 runs, 42 / 25 = 1.68 steps each.
    # All windows: drift 13 + 4 = 17 over err 28 + 8 = 36 (0.472) and exact 54 + 16 = 70 (0.243).
    # Last 3: drift (3 + 2 + 4) + (0 + 0 + 2) = 11 over err 18 + 6 = 24 (0.458) and exact 34 + 12 = 46 (0.239).
    # Gap: 100 x (2.2 - 2.0) / 2.0 = +10.0.
    assert lines[4] == "| 0.99 | 0 | +10.0 | 0.021 | 0.472 / 0.458 | 0.243 / 0.239 | 1.68 |"
    per_tensor = lines[-2:]
    # a: 30 / 1200 = 0.025, 9 / 18 = 0.500, 9 / 34 = 0.265, 30 / 20 = 1.50;
    # b: 12 / 800 = 0.015, 2 / 6 = 0.333, 2 / 12 = 0.167, 12 / 5 = 2.40.
    assert per_tensor == [
        "| a | 6 | 0.025 | 0.500 | 0.265 | 1.50 |",
        "| b | 4 | 0.015 | 0.333 | 0.167 | 2.40 |",
    ]
    assert "whole run" in lines[-4] and "last 3" in lines[-4]


def test_the_horizon_gap_is_the_window_means_relative_gap() -> None:
    exact = [4.0, 2.0, 1.0, 1.0, 9.0]  # windows of 2: means 3 and 1; the last step is no complete window
    mode = [4.5, 2.7, 1.2, 1.0, 0.0]  # means 3.6 and 1.1
    assert window_gaps(mode, exact, 2) == pytest.approx([20.0, 10.0])
    with pytest.raises(ValueError, match="runs of 4 and 5 steps"):
        window_gaps(mode[:4], exact, 2)


def test_the_horizon_table_pairs_each_seed_and_averages_the_windows(tmp_path: Path) -> None:
    for seed, (exact_losses, mode_losses, mode_val) in enumerate(
        [([5.5, 1.0, 2.0, 2.0], [5.5, 1.5, 2.2, 2.2], 2.2), ([5.5, 1.5, 1.0, 1.0], [5.5, 1.5, 1.1, 1.1], 2.1)]
    ):
        for mode, losses, val in (("exact", exact_losses, 2.0), ("1bit", mode_losses, mode_val)):
            record = {"workers": 64, "mode": mode, "beta2": 0.99, "seed": seed, "val_loss": val}
            (tmp_path / f"N64_{mode}_b2-0.99_seed{seed}.json").write_text(
                json.dumps({**record, "train_losses": losses})
            )
    lines = horizon_rows(tmp_path, 64, "1bit", 0.99, 2)
    # Seed 0: window means 3.25 vs 3.5 (+7.69%), 2.0 vs 2.2 (+10%); val +10%. Seed 1: 3.5 vs 3.5 (0), 1.0 vs 1.1
    # (+10%); val +5%. Means: +3.85, +10, +7.5.
    assert lines[4:] == [
        "| 0 | +7.69 | +10.00 | +10.00 |",
        "| 1 | +0.00 | +10.00 | +5.00 |",
        "| mean | +3.85 | +10.00 | +7.50 |",
    ]
    assert "| seed | 0-2 | 2-4 | val |" in lines


def test_a_sketchclip_mode_is_its_base_mode_with_option_clip_and_trains_without_deepspeeds_rule() -> None:
    clip = {"max_norm": 1.0}
    for base in ("1bit", "1bit_syncall128", "4bit_l1_a2a", "8bit_l1_a2a"):
        assert mode_options(f"{base}_sketchclip", 64) == {**mode_options(base, 64), "clip": clip}, base
    assert clip_of_run({"compression": "1bit", "clip": clip}, 1.0) == 0.0  # LionCub clips, the design's rule is off
    assert clip_of_run({"compression": "1bit"}, 1.0) == 1.0
    with pytest.raises(ValueError, match="clips at 1.0; the design at 0.0"):
        clip_of_run({"compression": "1bit", "clip": clip}, 0.0)
