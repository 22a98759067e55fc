"""benchmarks/study_batch_share.py: exact Lion's gap on a share of the batch and a mode's equivalent share,
worked out by hand from runs written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.study_batch_share import equivalent_share, rows, share_gaps, share_text
from benchmarks.study_grid import config_dir


def write_exact(root: Path, design: str, workers: int, seed: int, val: float, mode: str = "exact") -> None:
    directory = config_dir(root, "small", 300, design)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"workers": workers, "mode": mode, "beta2": 0.99, "seed": seed, "val_loss": val}
    record["train_losses"] = [5.5, 5.0]
    (directory / f"N{workers:02d}_{mode}_b2-0.99_seed{seed}.json").write_text(json.dumps(record))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for seed in (0, 1):
        write_exact(tmp_path, "lr5e-4", 8, seed, 2.0)
        write_exact(tmp_path, "lr5e-4", 64, seed, 2.0)
    write_exact(tmp_path, "lr5e-4", 8, 2, 2.0)  # no share run of seed 2: left out
    write_exact(tmp_path, "lr5e-4_batch40", 8, 0, 2.08)  # +4%
    write_exact(tmp_path, "lr5e-4_batch40", 8, 1, 2.06)  # +3%
    write_exact(tmp_path, "lr5e-4_batch56", 8, 0, 2.02)  # +1%
    write_exact(tmp_path, "lr5e-4_batch56", 8, 1, 2.02)
    write_exact(tmp_path, "lr5e-4", 64, 0, 2.045, mode="1bit")  # +2.25%
    write_exact(tmp_path, "lr5e-4", 64, 1, 2.045, mode="1bit")
    return tmp_path


def test_the_share_gaps_pair_by_seed(root: Path) -> None:
    curve = share_gaps(root, "small", 300, 8, 0.99)
    assert [share for share, _ in curve] == [40 / 64, 56 / 64]
    assert curve[0][1] == pytest.approx([4.0, 3.0]) and curve[1][1] == pytest.approx([1.0, 1.0])


def test_the_equivalent_share_is_linear_between_the_points_and_the_whole_batch() -> None:
    curve = [(0.625, 3.5), (0.875, 1.0)]
    assert equivalent_share(2.25, curve) == pytest.approx(0.625 + 0.25 * (3.5 - 2.25) / 2.5)  # 0.75
    assert equivalent_share(0.5, curve) == pytest.approx(0.875 + 0.125 * 0.5)  # between (0.875, 1) and (1, 0)
    assert equivalent_share(0.0, curve) == pytest.approx(1.0)
    assert equivalent_share(4.0, curve) is None  # beyond the smallest share's gap


def test_the_table_names_each_share_and_each_modes_equivalent(root: Path) -> None:
    text = "\n".join(rows(root, "small", 300, 64, 0.99, ["1bit", "4bit_l1_a2a"]))
    assert "| 0.625 | 40 | +3.5 ± 6.4 | 2 |" in text  # t(1) 12.706 x sd 0.707 / sqrt 2 = 6.35
    assert "| 0.875 | 56 | +1.0 ± 0.0 | 2 |" in text
    assert "| 1bit | +2.2 ± 0.0 | 2 | 0.75 |" in text
    assert "4bit_l1_a2a" not in text  # no runs: no row


def test_the_table_says_where_a_gap_is_beyond_the_curve() -> None:
    curve = [(0.625, 3.5), (0.875, 1.0)]
    assert share_text(2.25, curve) == "0.75"
    assert share_text(6.0, curve) == "below 0.625"  # more than exact Lion loses on the smallest share
    assert share_text(-0.4, curve) == "1"  # no loss: the whole batch
    assert share_text(2.0, []) == "n/a"  # no share runs
