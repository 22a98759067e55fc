"""From the convergence study's runs to the planner's decision: the report's verdicts (summarise, paired_gaps,
ef_target, ef_table, evidence) on run sets written here with losses chosen so that every gap, mean and spread
is worked out by hand below; the shipped ds_lioncub/planner/convergence_evidence.json against what the
documented command (benchmarks/RESULTS.md, ``python -m benchmarks.study_convergence --report --evidence ...``)
gives from the shipped runs; and the planner's choice on evidence files written here."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import study_convergence
from benchmarks.study_report import ef_table, ef_target, evidence, load_runs, paired_gaps, summarise
from ds_lioncub.planner import Candidate, Cluster
from ds_lioncub.planner.convergence import EVIDENCE_FILE, LOSS_THRESHOLD_PERCENT, choose, read_evidence

#: Each study mode's LionCub options, as benchmarks/study_convergence.py records them in a run's JSON.
OPTIONS: dict[str, dict[str, Any]] = {
    "exact": {"compression": "none"},
    "1bit": {"compression": "1bit"},
    "4bit_sign": {"compression": "kbit", "bits": 4, "quantizer": "sign", "kbit_algorithm": "alltoall"},
    "2bit_l1_a2a": {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    "2bit_l1_a2a_ef21": {
        "compression": "kbit",
        "bits": 2,
        "quantizer": "l1",
        "kbit_algorithm": "alltoall",
        "error_feedback": {"kind": "ef21"},
    },
    "4bit_l1_a2a": {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    "4bit_l1_a2a_ef_residual": {
        "compression": "kbit",
        "bits": 4,
        "quantizer": "l1",
        "kbit_algorithm": "alltoall",
        "error_feedback": {"kind": "residual", "feed_back": "all"},
    },
    "8bit_l1": {"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "allreduce"},
}

FIRST_LOSS = 5.5  # the loss before any update: the same for every run of a seed on the same corpus


def write_run(
    directory: Path,
    mode: str,
    workers: int,
    seed: int,
    val_loss: float,
    *,
    beta2: float = 0.99,
    first_loss: float = FIRST_LOSS,
    agreement: dict[str, float] | None = None,
    seconds_per_step: float = 1.0,
) -> None:
    """One run's JSON with the fields the report reads (benchmarks/study_convergence.py writes more)."""
    record = {
        "workers": workers,
        "mode": mode,
        "beta2": beta2,
        "seed": seed,
        "options": {"lr": 1e-3, "betas": [0.9, beta2], "weight_decay": 0.1, **OPTIONS[mode]},
        "val_loss": val_loss,
        "train_losses": [first_loss, first_loss - 0.5],
        "agreement": agreement,
        "seconds_per_step": seconds_per_step,
    }
    (directory / f"N{workers:02d}_{mode}_b2-{beta2}_seed{seed}.json").write_text(json.dumps(record))


def spread_of(values: list[float]) -> float:
    """2 x the sample standard deviation, written out (the reference for the report's spreads)."""
    mean = sum(values) / len(values)
    return 2.0 * math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@pytest.fixture
def study(tmp_path: Path) -> Path:
    """A small study at beta2 0.99 whose gaps are round numbers:

    32 workers, exact Lion over seeds 0-3 (val 2.0, 2.0, 1.6, 2.5):
      - 1-bit vote, seeds 0-2: val 2.10, 2.08, 1.696 -> gaps 5, 4, 6 % (mean 5, spread 2: a loss);
        agreement on seeds 0 and 1 only; seconds per step 1, 2, 3. Seed 3 has exact Lion alone.
      - 4-bit sign vote (the 1-bit vote's planner key), seed 0 only: val 2.02 -> gap 1 %.
      - 2-bit L1 all-to-all, seeds 0-2, but seed 2 trained another corpus (its first loss differs from its
        seed's others), so it is left out: val 2.20, 2.16 -> gaps 10, 8 % (mean 9, spread 2 sqrt 2, 2 seeds).
      - its EF21 form, seeds 0-1: val 2.04, 2.02 -> gaps 2, 1 % (mean 1.5: at most half of 9, met).
      - 8-bit L1 all-reduce, seeds 0-2: val 2.04, 2.04, 1.632 -> gaps 2, 2, 2 %: exactly the threshold.
    64 workers, exact Lion over seeds 0-1 (val 2.0, 2.0):
      - 4-bit L1 all-to-all: val 2.02, 2.04 -> gaps 1, 2 % (mean 1.5);
      - its residual EF form: val 2.04, 2.02 -> gaps 2, 1 % (mean 1.5: not worse, not half, missed).
    16 workers: a 1-bit run without any exact Lion run to pair it with.
    """
    directory = tmp_path / "gpt-small_300steps"
    directory.mkdir()
    for seed, val in enumerate([2.0, 2.0, 1.6, 2.5]):
        write_run(directory, "exact", 32, seed, val)
    agreements = [{"match": 0.8, "flip": 0.15, "tie": 0.1}, {"match": 0.9, "flip": 0.05, "tie": 0.2}, None]
    for seed, val in enumerate([2.10, 2.08, 1.696]):
        write_run(directory, "1bit", 32, seed, val, agreement=agreements[seed], seconds_per_step=seed + 1.0)
    write_run(directory, "4bit_sign", 32, 0, 2.02)
    write_run(directory, "2bit_l1_a2a", 32, 0, 2.20)
    write_run(directory, "2bit_l1_a2a", 32, 1, 2.16)
    write_run(directory, "2bit_l1_a2a", 32, 2, 1.0, first_loss=5.4)  # another corpus: left out
    write_run(directory, "2bit_l1_a2a_ef21", 32, 0, 2.04)
    write_run(directory, "2bit_l1_a2a_ef21", 32, 1, 2.02)
    for seed, val in enumerate([2.04, 2.04, 1.632]):
        write_run(directory, "8bit_l1", 32, seed, val)
    for seed, (exact, no_ef, ef) in enumerate([(2.0, 2.02, 2.04), (2.0, 2.04, 2.02)]):
        write_run(directory, "exact", 64, seed, exact)
        write_run(directory, "4bit_l1_a2a", 64, seed, no_ef)
        write_run(directory, "4bit_l1_a2a_ef_residual", 64, seed, ef)
    write_run(directory, "1bit", 16, 0, 2.0)
    return directory


def test_summarise_pairs_each_seed_with_exact_lions_and_leaves_out_seeds_either_lacks(study: Path) -> None:
    cells = load_runs(study)
    row = summarise(cells, 0.99, 32, "1bit")
    assert row is not None
    assert row["seeds"] == [0, 1, 2]  # exact Lion's seed 3 has no 1-bit run
    assert row["gap"].values == pytest.approx((5.0, 4.0, 6.0))
    assert row["gap"].mean == pytest.approx(5.0)
    assert row["gap"].spread == pytest.approx(2.0)  # deviations 0, -1, 1: sample variance 1
    assert row["gap"].real  # |5| > 2
    assert row["exact_val"].mean == pytest.approx((2.0 + 2.0 + 1.6) / 3)
    assert row["mode_val"].mean == pytest.approx((2.10 + 2.08 + 1.696) / 3)
    # Exact Lion's own seed spread is over every exact seed of the cell, seed 3 included.
    exact_vals = [2.0, 2.0, 1.6, 2.5]
    assert row["exact_spread_percent"] == pytest.approx(100.0 * spread_of(exact_vals) / (sum(exact_vals) / 4))
    # Seed 2 recorded no agreement: the rates are over seeds 0 and 1.
    assert row["rates"] == pytest.approx({"match": 0.85, "flip": 0.1, "tie": 0.15})
    assert row["seconds_per_step"] == pytest.approx(2.0)


def test_summarise_of_one_seed_has_no_spread_and_is_never_real(study: Path) -> None:
    row = summarise(load_runs(study), 0.99, 32, "4bit_sign")
    assert row is not None and row["seeds"] == [0]
    assert row["gap"].mean == pytest.approx(1.0)
    assert row["gap"].spread is None and not row["gap"].real
    assert row["rates"] is None  # its one run recorded no agreement


def test_a_run_on_another_corpus_leaves_its_cell_with_the_seeds_on_the_usual_one(study: Path) -> None:
    row = summarise(load_runs(study), 0.99, 32, "2bit_l1_a2a")
    assert row is not None and row["seeds"] == [0, 1]
    assert row["gap"].mean == pytest.approx(9.0)
    assert row["gap"].spread == pytest.approx(2.0 * math.sqrt(2.0))  # deviations 1, -1: sample variance 2


def test_summarise_has_no_row_without_exact_lion_or_without_the_mode(study: Path) -> None:
    cells = load_runs(study)
    assert summarise(cells, 0.99, 16, "1bit") is None  # no exact Lion run at 16 workers
    assert summarise(cells, 0.99, 32, "4bit_l1_a2a") is None  # no such run at 32 workers
    assert summarise(cells, 0.95, 32, "1bit") is None  # no run at that beta2


def test_paired_gaps_keeps_the_seeds_all_three_have(study: Path) -> None:
    seeds, ef_gaps, no_ef_gaps = paired_gaps(load_runs(study), 0.99, 32, "2bit_l1_a2a_ef21", "2bit_l1_a2a")
    assert seeds == [0, 1]
    assert ef_gaps == pytest.approx([2.0, 1.0]) and no_ef_gaps == pytest.approx([10.0, 8.0])


@pytest.mark.parametrize(
    ("no_ef_gap", "ef_gap", "met"),
    [
        (4.0, 2.0, True),  # exactly half
        (4.0, 2.001, False),  # just above half
        (4.0, -1.0, True),  # better than exact Lion
        (4.0, 5.0, False),  # worse
        (0.0, 0.0, True),  # no-EF no worse than exact Lion: EF must not exceed it
        (0.0, 0.1, False),
        (-1.0, -2.0, True),
        (-1.0, -0.5, False),  # above the no-EF gap, though below 0
    ],
)
def test_the_error_feedback_target(no_ef_gap: float, ef_gap: float, met: bool) -> None:
    assert ef_target(no_ef_gap, ef_gap) is met


def test_the_error_feedback_table_judges_each_cell_by_its_paired_means(study: Path) -> None:
    table = ef_table(load_runs(study), [0.99])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| 0.99")]
    by_cell = {(row[1], row[3]): row for row in rows}
    assert set(by_cell) == {("32", "ef21"), ("64", "residual (all)")}
    ef21 = by_cell[("32", "ef21")]
    # Over seeds 0 and 1 (the no-EF seed 2 is left out): no-EF 10, 8 (9 ± 2.83), EF 2, 1 (1.5 ± 1.41).
    assert ef21[4:8] == ["2", "+9.00 ± 2.83", "+1.50 ± 1.41", "2/2"]
    assert ef21[12] == "**met**"
    residual = by_cell[("64", "residual (all)")]
    # no-EF 1, 2; EF 2, 1: equal means (1.5), not half; EF below no-EF on seed 1 only.
    assert residual[4:8] == ["2", "+1.50 ± 1.41", "+1.50 ± 1.41", "1/2"]
    assert residual[12] == "missed"
    assert table.endswith("Target met in 1 of 2 cells.\n")
    assert ef_table(load_runs(study), [0.95]) == ""  # no cell at that beta2


def test_evidence_has_one_cell_per_planner_key_with_the_paired_gaps_mean_and_spread(study: Path) -> None:
    modes = ["1bit", "4bit_sign", "2bit_l1_a2a", "8bit_l1", "2bit_l1_a2a_ef21", "4bit_l1_a2a"]
    modes.append("4bit_l1_a2a_ef_residual")
    summary = evidence(study, [16, 32, 64], modes, [0.99])
    assert summary["source"] == "benchmarks/study_convergence.py, results gpt-small_300steps (benchmarks/RESULTS.md)"
    # 16 workers: no exact Lion to pair with; the 4-bit sign vote is the 1-bit vote's key, already taken;
    # the error-feedback forms are no planner evidence; rounded to 3 decimals: 2 sqrt 2 = 2.828.
    assert summary["cells"] == [
        {"mode": "1bit", "workers": 32, "beta2": 0.99, "gap_percent": 5.0, "spread_percent": 2.0, "seeds": 3},
        {
            "mode": "2bit-l1-alltoall",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 9.0,
            "spread_percent": 2.828,
            "seeds": 2,
        },
        {
            "mode": "8bit-l1-allreduce",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 2.0,
            "spread_percent": 0.0,
            "seeds": 3,
        },
        {
            "mode": "4bit-l1-alltoall",
            "workers": 64,
            "beta2": 0.99,
            "gap_percent": 1.5,
            "spread_percent": 1.414,
            "seeds": 2,
        },
    ]


def test_of_two_modes_with_one_planner_key_evidence_takes_the_first_listed(study: Path) -> None:
    summary = evidence(study, [32], ["4bit_sign", "1bit"], [0.99])
    # The 4-bit sign vote's one seed stands for the 1-bit vote: no spread, one seed.
    assert summary["cells"] == [
        {"mode": "1bit", "workers": 32, "beta2": 0.99, "gap_percent": 1.0, "spread_percent": None, "seeds": 1}
    ]


def candidate(label: str, params: dict[str, Any], seconds_per_step: float) -> Candidate:
    return Candidate(params, 0, seconds_per_step, 1, seconds_per_step, 0.0, label)


#: Fastest first, as the planner ranks them; under ZeRO stage 0 every rank votes (32 on one node of 32).
CANDIDATES = (
    candidate("1-bit vote", {"compression": "1bit"}, 1.0),
    candidate("2-bit L1 all-to-all", dict(OPTIONS["2bit_l1_a2a"]), 2.0),
    candidate("8-bit L1 all-reduce", dict(OPTIONS["8bit_l1"]), 3.0),
    candidate("exact Lion", {"compression": "none"}, 4.0),
)


def test_the_planner_passes_over_what_the_studys_runs_show_losing(study: Path, tmp_path: Path) -> None:
    path = tmp_path / "evidence.json"
    modes = ["1bit", "2bit_l1_a2a", "8bit_l1"]
    path.write_text(json.dumps(evidence(study, [32], modes, [0.99]), indent=1) + "\n")
    cells = read_evidence(path)
    choice = choose(CANDIDATES, Cluster(1, 32), 0.99, cells)
    # 1-bit: +5 ± 2 over 3 seeds, a loss; 2-bit L1: +9 over only 2 seeds (its third trained another corpus),
    # so the rule does not call it a loss, and it is kept.
    assert choice.best is CANDIDATES[1]
    assert [c for c, _ in choice.skipped] == [CANDIDATES[0]]
    assert choice.verdicts[0].note == "+5.0% ± 2.0 vs Lion's loss (32 workers, beta2 0.99, 3 seeds)"
    assert choice.verdicts[1].note == "+9.0% ± 2.8 vs Lion's loss (32 workers, beta2 0.99, 2 seeds)"
    assert "1-bit vote: +5.0% ± 2.0 vs Lion's loss" in choice.skipped_sentence()
    # Without the 2-bit runs, the 8-bit L1 cell, exactly at the threshold, is not a loss and is kept.
    choice = choose([CANDIDATES[0], *CANDIDATES[2:]], Cluster(1, 32), 0.99, cells)
    assert choice.best is CANDIDATES[2] and choice.verdicts[1].cell is not None
    assert choice.verdicts[1].cell.gap_percent == LOSS_THRESHOLD_PERCENT


def test_the_planner_reads_an_evidence_file_and_keeps_only_what_is_not_a_real_loss(tmp_path: Path) -> None:
    def cell(mode: str, gap: float, spread: float | None, seeds: int = 3) -> dict[str, Any]:
        return {
            "mode": mode,
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": gap,
            "spread_percent": spread,
            "seeds": seeds,
        }

    def best(*cells: dict[str, Any]) -> tuple[str, str]:
        path = tmp_path / "evidence.json"
        path.write_text(json.dumps({"source": "made up for this test", "cells": list(cells)}))
        choice = choose(CANDIDATES, Cluster(1, 32), 0.99, read_evidence(path))
        return choice.best.label, choice.skipped_sentence()

    losing = cell("1bit", 2.5, 0.4)  # above 2 % and beyond its spread, over 3 seeds
    assert best(losing) == (
        "2-bit L1 all-to-all",  # not in this study: kept, nothing says it loses
        "Faster but not recommended, the convergence study shows them losing more than 2% of Lion's loss: "
        "1-bit vote: +2.5% ± 0.4 vs Lion's loss (32 workers, beta2 0.99, 3 seeds) (benchmarks/RESULTS.md, "
        "'Convergence at 4-64 workers').",
    )
    assert best(cell("1bit", 2.0, 0.4)) == ("1-bit vote", "")  # at the threshold, not above it
    assert best(cell("1bit", 3.0, 3.0)) == ("1-bit vote", "")  # within its spread (equal to it)
    assert best(cell("1bit", 9.0, 0.4, seeds=2)) == ("1-bit vote", "")  # too few seeds to call it a loss
    assert best(cell("1bit", 9.0, None, seeds=1)) == ("1-bit vote", "")
    # Every compressed mode losing: exact Lion, and each passed-over mode is named with its number.
    label, sentence = best(losing, cell("2bit-l1-alltoall", 6.0, 1.0), cell("8bit-l1-allreduce", 2.1, 0.1))
    assert label == "exact Lion"
    assert "2-bit L1 all-to-all: +6.0% ± 1.0" in sentence and "8-bit L1 all-reduce: +2.1% ± 0.1" in sentence


def test_the_shipped_evidence_is_what_the_documented_command_gives_from_the_shipped_runs() -> None:
    # benchmarks/RESULTS.md: python -m benchmarks.study_convergence --report --evidence <the shipped file>,
    # with the command's defaults; its main() passes evidence() the modes other than exact Lion.
    args = study_convergence.parse_args(["--report", "--evidence", str(EVIDENCE_FILE)])
    directory = study_convergence.config_dir(args.results, args.task, args.steps)
    assert directory.name == "gpt-small_300steps" and any(directory.glob("N*_seed*.json"))
    regenerated = evidence(directory, args.workers, [m for m in args.modes if m != "exact"], args.beta2)
    shipped = json.loads(EVIDENCE_FILE.read_text())
    assert shipped["source"] == regenerated["source"]
    differing = [(a, b) for a, b in zip(shipped["cells"], regenerated["cells"], strict=False) if a != b]
    assert not differing, f"shipped vs regenerated: {differing}"
    assert shipped == regenerated, f"{len(shipped['cells'])} cells shipped, {len(regenerated['cells'])} regenerated"
