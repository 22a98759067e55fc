"""From the convergence study's runs to the planner's decision: the report's verdicts (study_report's
summarise, paired_gaps, ef_target, ef_table; study_evidence's evidence) on run sets written here with losses
chosen so that every gap, mean and 95% Student-t half-width is worked out by hand below (with the t
quantiles' closed forms at 1 and 2 degrees of freedom, T1 and T2); the shipped
ds_lioncub/planner/convergence_evidence.json against what the documented commands (benchmarks/RESULTS.md,
``python -m benchmarks.study_convergence --results benchmarks/results/convergence_study --evidence ...``) give
from the shipped runs; each cell's kappa (through exact Lion's batch-share runs) and measured r (through longer
schedules), worked out by hand; and the planner's ranking by step time x r on evidence files written here, in the
current form and in the older one with ``spread_percent``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import study_convergence, study_grid
from benchmarks.study_evidence import bits_per_element, evidence, merge_evidence
from benchmarks.study_report import ef_table, ef_target, load_runs, paired_gaps, summarise
from ds_lioncub.planner import Candidate, Cluster
from ds_lioncub.planner.convergence import EVIDENCE_FILE, choose, read_evidence
from ds_lioncub.planner.time_to_loss import JobBatch

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
    "1bit_sketchclip": {"compression": "1bit", "clip": {"max_norm": 1.0}},
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

# The 0.975 quantiles of Student's t, from its CDF's closed forms: 1 degree of freedom (Cauchy),
# P(|T| < t) = 2 atan(t) / pi; 2 degrees, t / sqrt(2 + t^2).
T1 = math.tan(0.95 * math.pi / 2)  # 12.706
T2 = 0.95 * math.sqrt(2 / (1 - 0.95**2))  # 4.303


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
      - 1-bit vote, seeds 0-2: val 2.10, 2.08, 1.696 -> gaps 5, 4, 6 % (mean 5, sd 1, half-width T2 / sqrt 3
        = 2.48: the interval [2.52, 7.48] lies above 2 %, a loss);
        agreement on seeds 0 and 1 only; seconds per step 1, 2, 3. Seed 3 has exact Lion alone.
      - 4-bit sign vote (the 1-bit vote's planner key), seed 0 only: val 2.02 -> gap 1 %.
      - 2-bit L1 all-to-all, seeds 0-2, but seed 2 trained another corpus (its first loss differs from its
        seed's others), so it is left out: val 2.20, 2.16 -> gaps 10, 8 % (mean 9, sd sqrt 2, half-width
        T1 sqrt 2 / sqrt 2 = 12.71, 2 seeds).
      - its EF21 form, seeds 0-1: val 2.04, 2.02 -> gaps 2, 1 % (mean 1.5: at most half of 9, met).
      - 8-bit L1 all-reduce, seeds 0-2: val 2.04, 2.04, 1.632 -> gaps 2, 2, 2 %: exactly the threshold, half-width 0.
    64 workers, exact Lion over seeds 0-1 (val 2.0, 2.0):
      - 4-bit L1 all-to-all: val 2.02, 2.04 -> gaps 1, 2 % (mean 1.5, sd sqrt(1/2), half-width T1 / 2 = 6.35);
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
    assert row["gap"].half_width == pytest.approx(T2 / math.sqrt(3))  # deviations 0, -1, 1: sample variance 1
    assert row["gap"].real  # the interval [2.52, 7.48] excludes 0
    assert row["exact_val"].mean == pytest.approx((2.0 + 2.0 + 1.6) / 3)
    assert row["mode_val"].mean == pytest.approx((2.10 + 2.08 + 1.696) / 3)
    # Exact Lion's own seed spread (2 x sample sd, no interval) is over every exact seed of the cell, seed 3 too.
    exact_vals = [2.0, 2.0, 1.6, 2.5]
    assert row["exact_spread_percent"] == pytest.approx(100.0 * spread_of(exact_vals) / (sum(exact_vals) / 4))
    # Seed 2 recorded no agreement: the rates are over seeds 0 and 1.
    assert row["rates"] == pytest.approx({"match": 0.85, "flip": 0.1, "tie": 0.15})
    assert row["seconds_per_step"] == pytest.approx(2.0)


def test_summarise_of_one_seed_has_no_interval_and_is_never_real(study: Path) -> None:
    row = summarise(load_runs(study), 0.99, 32, "4bit_sign")
    assert row is not None and row["seeds"] == [0]
    assert row["gap"].mean == pytest.approx(1.0)
    assert row["gap"].half_width is None and not row["gap"].real
    assert row["rates"] is None  # its one run recorded no agreement


def test_a_run_on_another_corpus_leaves_its_cell_with_the_seeds_on_the_usual_one(study: Path) -> None:
    row = summarise(load_runs(study), 0.99, 32, "2bit_l1_a2a")
    assert row is not None and row["seeds"] == [0, 1]
    assert row["gap"].mean == pytest.approx(9.0)
    # deviations 1, -1: sample variance 2; half-width T1 x sqrt 2 / sqrt 2, which holds 0: not real
    assert row["gap"].half_width == pytest.approx(T1)
    assert not row["gap"].real


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
    # Over seeds 0 and 1 (the no-EF seed 2 is left out): no-EF 10, 8 (9 ± T1 = 12.71), EF 2, 1 (1.5 ± T1 / 2).
    assert ef21[4:8] == ["2", f"+9.00 ± {T1:.2f}", f"+1.50 ± {T1 / 2:.2f}", "2/2"]
    assert (f"{T1:.2f}", f"{T1 / 2:.2f}") == ("12.71", "6.35")
    assert ef21[12] == "**met**"
    residual = by_cell[("64", "residual (all)")]
    # no-EF 1, 2; EF 2, 1: equal means (1.5), not half; EF below no-EF on seed 1 only.
    assert residual[4:8] == ["2", "+1.50 ± 6.35", "+1.50 ± 6.35", "1/2"]
    assert residual[12] == "missed"
    assert table.endswith("Target met in 1 of 2 cells.\n")
    assert ef_table(load_runs(study), [0.95]) == ""  # no cell at that beta2


def test_evidence_has_one_cell_per_planner_key_with_the_paired_gaps_mean_and_interval(study: Path) -> None:
    modes = ["1bit", "4bit_sign", "2bit_l1_a2a", "8bit_l1", "2bit_l1_a2a_ef21", "4bit_l1_a2a"]
    modes.append("4bit_l1_a2a_ef_residual")
    summary = evidence(study, [16, 32, 64], modes, [0.99])
    assert summary["source"] == (
        f"benchmarks/study_convergence.py, results {study.parent.name}/gpt-small_300steps (benchmarks/RESULTS.md)"
    )
    # 16 workers: no exact Lion to pair with; the 4-bit sign vote is the 1-bit vote's key, already taken;
    # the error-feedback forms are no planner evidence. Half-widths rounded to 3 decimals: T2 / sqrt 3 = 2.484,
    # T1 = 12.706 (2 seeds, sd sqrt 2), T1 / 2 = 6.353 (2 seeds, sd sqrt(1/2)).
    assert summary["cells"] == [
        {
            "mode": "1bit",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 5.0,
            "half_width_percent": 2.484,
            "seeds": 3,
            "bits_per_element": 1,
        },
        {
            "mode": "2bit-l1-alltoall",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 9.0,
            "half_width_percent": 12.706,
            "seeds": 2,
            "bits_per_element": 2,
        },
        {
            "mode": "8bit-l1-allreduce",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 2.0,
            "half_width_percent": 0.0,
            "seeds": 3,
            "bits_per_element": 8,
        },
        {
            "mode": "4bit-l1-alltoall",
            "workers": 64,
            "beta2": 0.99,
            "gap_percent": 1.5,
            "half_width_percent": 6.353,
            "seeds": 2,
            "bits_per_element": 4,
        },
    ]
    assert (round(T2 / math.sqrt(3), 3), round(T1, 3), round(T1 / 2, 3)) == (2.484, 12.706, 6.353)


def test_of_two_modes_with_one_planner_key_evidence_takes_the_first_listed(study: Path) -> None:
    summary = evidence(study, [32], ["4bit_sign", "1bit"], [0.99])
    # The 4-bit sign vote's one seed stands for the 1-bit vote: no interval, one seed, the 1-bit vote's 1 bit.
    assert summary["cells"] == [
        {
            "mode": "1bit",
            "workers": 32,
            "beta2": 0.99,
            "gap_percent": 1.0,
            "half_width_percent": None,
            "seeds": 1,
            "bits_per_element": 1,
        }
    ]


@pytest.mark.parametrize("workers", [4, 32, 64])
def test_bits_per_element_is_each_ranks_message_over_its_elements(workers: int) -> None:
    # The rank's first message carries one field per element: 1 bit for the signs, b bits for a b-bit vote,
    # whatever the count of workers and the algorithm.
    assert bits_per_element(OPTIONS["1bit"], workers) == 1
    assert bits_per_element({**OPTIONS["1bit"], "momentum_sync": {"interval": 10, "layers": "auto"}}, workers) == 1
    assert bits_per_element(OPTIONS["2bit_l1_a2a"], workers) == 2
    assert bits_per_element(OPTIONS["4bit_l1_a2a"], workers) == 4
    assert bits_per_element(OPTIONS["4bit_sign"], workers) == 4
    assert bits_per_element(OPTIONS["8bit_l1"], workers) == 8
    # Exact Lion's all-reduce: its dtype's bits (the planner's table shows them beside the votes').
    assert bits_per_element(OPTIONS["exact"], workers) == 32
    assert bits_per_element({"compression": "none", "comm_dtype": "bf16"}, workers) == 16


def candidate(label: str, params: dict[str, Any], seconds_per_step: float) -> Candidate:
    return Candidate(params, 0, seconds_per_step, 1, seconds_per_step, 0.0, label)


@pytest.fixture
def timed_study(tmp_path: Path) -> Path:
    """The batch share's design (lr5e-4) with exact Lion's share runs and a longer schedule, beta2 0.99:

    - exact Lion at 8 workers on the whole batch (64 windows), seeds 0-2: val 2.0; on 40 windows 2.08 (+4%) and on
      56 windows 2.02 (+1%) each: the share curve (0.625, 4), (0.875, 1);
    - exact Lion at 32 workers, seeds 0-2: 2.0. The 1-bit vote with clip: 2.05, 2.04, 2.06 after 300 steps (gaps
      2.5, 2, 3: mean 2.5, sd 0.5, half-width T2 x 0.5 / sqrt 3 = 1.242), and 1.90 each after a 375-step schedule;
    - 2-bit L1 all-to-all: 2.2 each (+10%, no spread), beyond the curve's smallest share.
    """
    root = tmp_path / "convergence_pinned"
    share_runs = {"lr5e-4": 2.0, "lr5e-4_batch40": 2.08, "lr5e-4_batch56": 2.02}
    for design, val in share_runs.items():
        directory = study_grid.config_dir(root, "small", 300, design)
        directory.mkdir(parents=True)
        for seed in range(3):
            write_run(directory, "exact", 8, seed, val)
    whole = study_grid.config_dir(root, "small", 300, "lr5e-4")
    longer = study_grid.config_dir(root, "small", 375, "lr5e-4")
    longer.mkdir()
    for seed, val in enumerate([2.05, 2.04, 2.06]):
        write_run(whole, "exact", 32, seed, 2.0)
        write_run(whole, "1bit_sketchclip", 32, seed, val)
        write_run(longer, "1bit_sketchclip", 32, seed, 1.90)
        write_run(whole, "2bit_l1_a2a", 32, seed, 2.2)
    return whole


def test_the_cells_carry_kappa_through_the_share_curve_and_r_from_the_longer_runs(timed_study: Path) -> None:
    summary = evidence(timed_study, [32], ["1bit_sketchclip", "2bit_l1_a2a"], [0.99])
    cells = {cell["mode"]: cell for cell in summary["cells"]}
    half_width = T2 * 0.5 / math.sqrt(3)

    # kappa: linear between (0.625, 4) and (0.875, 1) at the gap 2.5 and its interval's ends.
    def share(gap: float) -> float:
        return 0.625 + 0.25 * (4 - gap) / 3

    clipped = cells["1bit+clip"]
    assert clipped["kappa"] == round(share(2.5), 3) == 0.75
    assert clipped["kappa_low"] == round(share(2.5 + half_width), 3)
    assert clipped["kappa_high"] == round(share(2.5 - half_width), 3)
    assert clipped["kappa_extrapolated"] is False
    # r: the 375-step run reaches 2.0 at 300 + 75 x (v - 2) / (v - 1.9) steps, in units of 300.
    ratios = [(300 + 75 * (v - 2.0) / (v - 1.90)) / 300 for v in (2.05, 2.04, 2.06)]
    mean = sum(ratios) / 3
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2)
    assert clipped["r"] == round(mean, 4) and clipped["r_seeds"] == 3
    assert clipped["r_half_width"] == round(T2 * sd / math.sqrt(3), 4)
    assert clipped["r_batch_samples"] == 64
    # 2-bit L1, +10% with no spread: beyond the smallest share, on gap = a + c / share through the curve's points.
    slope = (4 - 1) / (1 / 0.625 - 1 / 0.875)
    two_bit = cells["2bit-l1-alltoall"]
    assert two_bit["kappa"] == round(1 / (1 / 0.625 + (10 - 4) / slope), 3)
    assert two_bit["kappa_extrapolated"] is True and "r" not in two_bit
    assert "kappa (benchmarks/study_batch_share.py) in 2 of 2 cells" in summary["time_to_loss"]
    assert "r measured (benchmarks/study_time_to_loss.py) for 1bit+clip at 32 workers" in summary["time_to_loss"]


def test_a_measured_r_carries_the_noise_scale_of_exact_lions_runs_with_noise_terms(
    timed_study: Path, tmp_path: Path
) -> None:
    sweep = study_grid.config_dir(tmp_path / "batch_sweep", "small", 300, "lr5e-4")
    sweep.mkdir(parents=True)
    # Two exact runs at 16 workers (4 windows per worker): |G|^2 and tr(Sigma) per step; steps 0-9 are skipped.
    for seed, (square, trace) in enumerate([(2.0, 10.0), (4.0, 30.0)]):
        terms = {"gradient_square": [99.0] * 10 + [square] * 290, "trace_per_worker_batch": [1.0] * 10 + [trace] * 290}
        record = {"val_loss": 2.0, "noise_terms": {**terms, "worker_windows": 4}}
        (sweep / f"N16_exact_b2-0.99_seed{seed}.json").write_text(json.dumps(record))
    (sweep / "N16_1bit_sketchclip_b2-0.99_seed0.json").write_text(json.dumps({"val_loss": 2.1}))  # not exact Lion
    summary = evidence(timed_study, [32], ["1bit_sketchclip"], [0.99], tmp_path / "batch_sweep")
    clipped = summary["cells"][0]
    # B_simple = b x tr(Sigma) / |G|^2 per run: 4 x 10 / 2 = 20 and 4 x 30 / 4 = 30; their mean.
    assert clipped["r_noise_scale_samples"] == 25.0 and clipped["r_noise_scale_runs"] == 2
    read = read_evidence_text(tmp_path, summary)
    assert read.measured_ratio is not None and read.measured_ratio.noise_scale_samples == 25.0
    # No noise root, or one without such runs: no noise scale.
    assert "r_noise_scale_samples" not in evidence(timed_study, [32], ["1bit_sketchclip"], [0.99])["cells"][0]
    empty = evidence(timed_study, [32], ["1bit_sketchclip"], [0.99], tmp_path / "nowhere")
    assert "r_noise_scale_samples" not in empty["cells"][0]


def read_evidence_text(tmp_path: Path, summary: dict[str, Any]) -> Any:
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps(summary))
    return read_evidence(path)[0]


def test_the_planner_ranks_the_studys_cells_by_step_time_times_r(timed_study: Path, tmp_path: Path) -> None:
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps(evidence(timed_study, [32], ["1bit_sketchclip", "2bit_l1_a2a"], [0.99])))
    cells = read_evidence(path)
    vote = candidate("1-bit vote + clip", {"compression": "1bit", "clip": {"max_norm": 1.0}}, 1.0)
    two_bit = candidate("2-bit L1 all-to-all", dict(OPTIONS["2bit_l1_a2a"]), 0.9)
    exact = candidate("exact Lion", {"compression": "none"}, 2.0)
    candidates = (two_bit, vote, exact)  # fastest per step first, as the planner lists them
    kappa_two_bit = 1 / (1 / 0.625 + (10 - 4) / ((4 - 1) / (1 / 0.625 - 1 / 0.875)))
    # Noise scale unknown: the worst case, 1/kappa. The vote 1.0 s x 1/0.75 = 1.33 s; 2-bit L1 0.9 s x 1/0.398 =
    # 2.26 s; exact Lion 2 s. The vote is first to Lion's loss; 2-bit L1, faster per step, is passed over for it.
    choice = choose(candidates, Cluster(1, 32), 0.99, cells)
    assert choice.best is vote and [c for c, _ in choice.skipped] == [two_bit]
    assert choice.ratio_of(vote).value == pytest.approx(1 / 0.75) and choice.ratio_of(vote).basis == "worst case"
    assert choice.ratio_of(two_bit).value == pytest.approx(1 / round(kappa_two_bit, 3))
    assert choice.ratio_of(exact).value == 1.0
    # The measured r is the study's, at the study's batch: printed beside, not used (its noise scale unrecorded).
    assert "measured at the study's batch: 1.08" in choice.ratio_of(vote).note
    # B = B_noise: r = (1 + 1/kappa) / 2, the vote 1.17 s, 2-bit L1 0.9 x (1 + 1/0.398) / 2 = 1.58 s.
    model = choose(candidates, Cluster(1, 32), 0.99, cells, job=JobBatch(4096, 4096))
    assert model.best is vote and model.ratio_of(vote).basis == "model"
    assert model.ratio_of(vote).value == pytest.approx((1 + 1 / 0.75) / 2)


def _cell(mode: str, gap: float, half_width: float | None, seeds: int = 3) -> dict[str, Any]:
    """An evidence file's cell at 32 workers, beta2 0.99, in the current form."""
    return {
        "mode": mode,
        "workers": 32,
        "beta2": 0.99,
        "gap_percent": gap,
        "half_width_percent": half_width,
        "seeds": seeds,
        "bits_per_element": 1,
    }


def test_a_cell_reads_back_with_its_kappa_and_measured_r(tmp_path: Path) -> None:
    path = tmp_path / "evidence.json"
    timed = {**_cell("1bit", 2.5, 1.0), "kappa": 0.75, "kappa_low": 0.7, "kappa_high": 0.8, "kappa_extrapolated": False}
    timed.update({"r": 1.06, "r_half_width": 0.02, "r_seeds": 4, "r_batch_samples": 64})
    path.write_text(json.dumps({"source": "made up for this test", "cells": [timed, _cell("1bit", 1.0, None, 1)]}))
    first, second = read_evidence(path)
    assert first.kappa is not None and (first.kappa.value, first.kappa.low, first.kappa.high) == (0.75, 0.7, 0.8)
    assert first.measured_ratio is not None
    assert (first.measured_ratio.value, first.measured_ratio.half_width, first.measured_ratio.seeds) == (1.06, 0.02, 4)
    assert first.measured_ratio.batch_samples == 64 and first.measured_ratio.noise_scale_samples is None
    assert second.kappa is None and second.measured_ratio is None


def test_an_older_file_with_the_spread_gives_the_same_interval(tmp_path: Path) -> None:
    # The shipped file before half-widths: spread = 2 x sample sd of the per-seed gaps, no bits.
    path = tmp_path / "old.json"
    old_cells = [
        {"mode": "1bit", "workers": 32, "beta2": 0.99, "gap_percent": 3.344, "spread_percent": 2.406, "seeds": 3},
        {"mode": "1bit", "workers": 64, "beta2": 0.99, "gap_percent": 4.0, "spread_percent": 1.0, "seeds": 2},
        {"mode": "1bit", "workers": 4, "beta2": 0.99, "gap_percent": 1.0, "spread_percent": None, "seeds": 1},
    ]
    path.write_text(json.dumps({"source": "an older study", "cells": old_cells}))
    three, two, one = read_evidence(path)
    # sd = spread / 2; half-width t(seeds - 1) x sd / sqrt(seeds)
    assert three.half_width_percent == pytest.approx(T2 * 1.203 / math.sqrt(3))  # 2.989: [+0.36, +6.33]
    assert two.half_width_percent == pytest.approx(T1 * 0.5 / math.sqrt(2))
    assert one.half_width_percent is None
    assert (three.bits_per_element, three.seeds, three.gap_percent) == (None, 3, 3.344)
    assert not three.loses and three.undecided  # 3.344 - 2.989 = 0.355 < 2


@pytest.mark.parametrize(
    "change",
    [
        {"half_width_percent": "2.0"},  # a string
        {"bits_per_element": 1.0},  # not a whole number of bits
        {"seeds": 3.0},
        {"kappa": "0.7"},  # kappa not a number
        {"r": 1.05},  # r without its seeds
        {"r": 1.05, "r_seeds": 4, "r_half_width": "0.1"},
    ],
)
def test_a_malformed_cell_is_named(tmp_path: Path, change: dict[str, Any]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"cells": [_cell("1bit", 1.0, 0.5), {**_cell("1bit", 1.0, 0.5), **change}]}))
    with pytest.raises(ValueError, match=r"cell 1 of .*bad.json is not \{mode: str"):
        read_evidence(path)


def test_a_cell_without_half_width_or_spread_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    cell = {key: value for key, value in _cell("1bit", 1.0, 0.5).items() if key != "half_width_percent"}
    path.write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(ValueError, match=r"cell 0 of .*\(or an older file's spread_percent\)"):
        read_evidence(path)


#: benchmarks/RESULTS.md's two commands for the shipped evidence: the first study's cells, then the pinned
#: corpus's sharper cells (design lr5e-4) in place of theirs at the points it measured whole.
FIRST_STUDY_COMMAND = ["--results", str(study_grid.STDLIB_RESULTS), "--evidence", "first.json"]
PINNED_COMMAND = [
    "--design", "lr5e-4", "--workers", "8", "16", "32", "64", "--beta2", "0.95", "0.99",
    "--modes", "exact", "1bit", "1bit_sync", "2bit_l1_a2a", "4bit_l1_a2a", "8bit_l1", "8bit_l1_a2a",
    "1bit_sketchclip", "4bit_l1_a2a_sketchclip", "8bit_l1_a2a_sketchclip",
    "--evidence", str(EVIDENCE_FILE), "--evidence-base", "first.json",
    "--noise-scale-from", str(study_grid.STDLIB_RESULTS.parent / "batch_sweep"),
]  # fmt: skip


def summary_of(argv: list[str]) -> dict[str, Any]:
    """What ``study_convergence.main(argv)`` writes to ``--evidence``, without writing the reports."""
    args = study_convergence.parse_args(argv)
    directory = study_grid.config_dir(args.results, args.task, args.steps, args.design[0])
    assert any(directory.glob("N*_seed*.json")), directory
    return evidence(directory, args.workers, [m for m in args.modes if m != "exact"], args.beta2, args.noise_scale_from)


def test_the_shipped_evidence_is_what_the_documented_commands_give_from_the_shipped_runs() -> None:
    regenerated = merge_evidence(summary_of(FIRST_STUDY_COMMAND), summary_of(PINNED_COMMAND))
    shipped = json.loads(EVIDENCE_FILE.read_text())
    assert shipped["source"] == regenerated["source"]
    differing = [(a, b) for a, b in zip(shipped["cells"], regenerated["cells"], strict=False) if a != b]
    assert not differing, f"shipped vs regenerated: {differing}"
    assert shipped == regenerated, f"{len(shipped['cells'])} cells shipped, {len(regenerated['cells'])} regenerated"


def test_evidence_alone_writes_the_summary_and_leaves_the_report_and_a_mode_with_clip_has_its_key(
    study: Path, tmp_path: Path
) -> None:
    """``--evidence`` without ``--report`` writes only the summary; a mode with option clip (val 2.02, 2.02, 1.616
    against exact 2.0, 2.0, 1.6: gaps 1, 1, 1 %) is its own planner key, "1bit+clip", of 1 bit per element."""
    for seed, val in enumerate([2.02, 2.02, 1.616]):
        write_run(study, "1bit_sketchclip", 32, seed, val)
    out = tmp_path / "evidence.json"
    argv = ["--results", str(study.parent), "--workers", "32", "--beta2", "0.99", "--evidence", str(out)]
    assert study_convergence.main([*argv, "--modes", "exact", "1bit", "1bit_sketchclip"]) == 0
    assert not (study / "report.md").exists()
    cells = {cell["mode"]: cell for cell in json.loads(out.read_text())["cells"]}
    assert set(cells) == {"1bit", "1bit+clip"}
    clipped = cells["1bit+clip"]
    assert (clipped["gap_percent"], clipped["half_width_percent"], clipped["seeds"]) == (1.0, 0.0, 3)
    assert clipped["bits_per_element"] == 1
    assert study_convergence.main(["--report", *argv, "--modes", "exact", "1bit"]) == 0
    assert (study / "report.md").exists()


def test_merged_evidence_takes_the_newer_points_whole_and_keeps_the_rest(tmp_path: Path) -> None:
    def cell(mode: str, workers: int, beta2: float, gap: float) -> dict:
        return {
            "mode": mode,
            "workers": workers,
            "beta2": beta2,
            "gap_percent": gap,
            "half_width_percent": 1.0,
            "seeds": 3,
            "bits_per_element": 1,
        }

    base = {
        "source": "first",
        "cells": [cell("1bit", 32, 0.99, 3.3), cell("1bit", 64, 0.99, 4.4), cell("4bit-l1-alltoall", 64, 0.99, 2.3)],
    }
    newer = {
        "source": "second",
        "cells": [cell("1bit", 64, 0.99, 8.5), cell("4bit-l1-alltoall", 64, 0.99, 6.0), cell("1bit", 64, 0.95, 1.0)],
    }
    merged = merge_evidence(base, newer)
    by_key = {(c["mode"], c["workers"], c["beta2"]): (c["gap_percent"], c["source"]) for c in merged["cells"]}
    assert by_key == {
        ("1bit", 32, 0.99): (3.3, "first"),
        ("1bit", 64, 0.99): (8.5, "second"),
        ("4bit-l1-alltoall", 64, 0.99): (6.0, "second"),
        ("1bit", 64, 0.95): (1.0, "second"),
    }
    assert merged["source"] == "second; other cells: first"
    # The planner reads the merged file (the cells' "source" is not in its way).
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(merged))
    assert sorted(c.gap_percent for c in read_evidence(path)) == [1.0, 3.3, 6.0, 8.5]
    # A point the newer study measured only in part is refused: its other modes would keep noisier cells.
    partial = {"source": "second", "cells": [cell("1bit", 64, 0.99, 8.5)]}
    with pytest.raises(ValueError, match=r"lacks \['4bit-l1-alltoall'\] at 64 workers, beta2 0.99"):
        merge_evidence(base, partial)
