"""Time to exact Lion's loss in the planner: r's model and its worked examples, where r comes from, the ranking
by step time x r on evidence written here (never the shipped cells), the cell a mode is judged by, and what the
command line prints and keeps on stdout.

Each reference is computed here another way: the steps written out from S = S_min (1 + B_noise / B), a plain loop
over the candidates for the ranking."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_lioncub.planner import Candidate, Cluster
from ds_lioncub.planner.cli import main
from ds_lioncub.planner.convergence import SHIPPED_STUDY, StudyCell, assess, choose
from ds_lioncub.planner.time_to_loss import (
    JobBatch,
    Kappa,
    MeasuredRatio,
    kappa_from_ratio,
    model_ratio,
    steps_ratio,
    worst_case_ratio,
)
from tests.support.launch import REPO


def steps_to_loss(batch: float, noise: float) -> float:
    """McCandlish et al.'s steps to a loss, in units of S_min: 1 + B_noise / B."""
    return 1 + noise / batch


def test_the_worked_examples_of_the_issue() -> None:
    kappa = 2 / math.pi  # a majority of Gaussian signs: the sign test's efficiency against the mean
    # At B = B_noise, exact Lion needs 2 S_min; the mode, on kappa B of effective batch, 1 + pi/2.
    at_noise = steps_to_loss(kappa * 1.0, 1.0) / steps_to_loss(1.0, 1.0)
    assert at_noise == pytest.approx((1 + math.pi / 2) / 2)
    assert round(model_ratio(kappa, 1.0), 2) == round(at_noise, 2) == 1.29
    # At B = 4 B_noise: (1 + pi/8) / (1 + 1/4).
    at_four = steps_to_loss(kappa * 4.0, 1.0) / steps_to_loss(4.0, 1.0)
    assert round(model_ratio(kappa, 4.0), 2) == round(at_four, 2) == 1.11
    assert worst_case_ratio(kappa) == pytest.approx(math.pi / 2)


@pytest.mark.parametrize("kappa", [0.2, 0.64, 0.85, 1.0])
def test_r_runs_from_one_over_kappa_far_below_the_noise_scale_to_one_far_above(kappa: float) -> None:
    assert model_ratio(kappa, 1e-9) == pytest.approx(1 / kappa, rel=1e-6)
    assert model_ratio(kappa, 1e9) == pytest.approx(1.0, rel=1e-6)
    ratios = [model_ratio(kappa, x) for x in (0.1, 0.5, 1, 2, 8)]
    assert ratios == sorted(ratios, reverse=True)  # a larger batch against the noise costs fewer extra steps
    with pytest.raises(ValueError, match="kappa"):
        model_ratio(0.0, 1.0)


@pytest.mark.parametrize("kappa", [0.3, 0.9, 1.0, 1.4, 5.0])
@pytest.mark.parametrize("x", [0.2, 1.0, 7.0])
def test_kappa_from_ratio_gives_back_the_kappa_of_a_ratio(kappa: float, x: float) -> None:
    r = steps_to_loss(kappa * x, 1.0) / steps_to_loss(x, 1.0)
    assert kappa_from_ratio(r, x) == pytest.approx(kappa)
    assert worst_case_ratio(kappa) == pytest.approx(max(1.0, 1 / kappa))


def ratio_through_measured(measured: float, study: float, job: float) -> float:
    """r at B / B_noise = ``job`` for a mode measured at ``measured`` at B / B_noise = ``study``, solved by bisection
    for the effective batch share k that gives the measurement at the study's point, then S's ratio at the job's."""

    def ratio(k: float, x: float) -> float:
        return steps_to_loss(k * x, 1.0) / steps_to_loss(x, 1.0)

    low, high = 1e-6, 1e6  # ratio(k, x) falls as k grows
    for _ in range(200):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if ratio(middle, study) > measured else (low, middle)
    return ratio(math.sqrt(low * high), job)


def test_a_measured_r_below_one_stays_below_one_at_every_batch_and_its_worst_case_is_one() -> None:
    study = MeasuredRatio(0.95, 0.02, 8, batch_samples=64, noise_scale_samples=32)  # beat exact Lion at x = 2
    for x in (0.1, 1.0, 4.0, 100.0):
        found = steps_ratio(Kappa(0.75, 0.6, 0.9), study, JobBatch(64 * x, 64))
        assert found.basis == "model" and found.value < 1
        assert found.value == pytest.approx(ratio_through_measured(0.95, 2.0, x), rel=1e-6)
    worst = steps_ratio(Kappa(0.75, 0.6, 0.9), study, JobBatch())
    assert (worst.basis, worst.value) == ("worst case", 1.0)  # r -> 1 as the batch outgrows the noise
    # An r no finite kappa gives at the study's point (r <= x / (1 + x)): the model's floor, x / (1 + x), elsewhere.
    floor = steps_ratio(None, MeasuredRatio(0.6, None, 1, 64, 32), JobBatch(64 * 8, 64))
    assert floor.value == pytest.approx(8 / 9)


def test_where_r_comes_from() -> None:
    kappa = Kappa(0.75, 0.6, 0.9)
    unknown = JobBatch()
    worst = steps_ratio(kappa, None, unknown)
    assert (worst.basis, worst.value, worst.low, worst.high) == ("worst case", 1 / 0.75, 1 / 0.9, 1 / 0.6)
    assert "noise scale unknown" in worst.note
    job = JobBatch(global_batch=2048, noise_scale=1024)  # B / B_noise = 2
    model = steps_ratio(kappa, None, job)
    assert model.basis == "model" and model.value == pytest.approx((1 + 1 / (0.75 * 2)) / 1.5)
    assert (model.low, model.high) == (pytest.approx((1 + 1 / 1.8) / 1.5), pytest.approx((1 + 1 / 1.2) / 1.5))
    # A measurement takes precedence at the study's batch: where the job's B / B_noise is the study's.
    study = MeasuredRatio(1.06, 0.02, 4, batch_samples=64, noise_scale_samples=32)  # the study at B / B_noise = 2
    measured = steps_ratio(kappa, study, job)
    assert (measured.basis, measured.value, measured.low, measured.high) == ("measured", 1.06, 1.04, 1.08)
    # Elsewhere (B / B_noise = 4): the model with the kappa that gives the measured r at the study's B / B_noise.
    elsewhere = steps_ratio(kappa, study, JobBatch(4096, 1024))
    assert elsewhere.basis == "model" and "r measured at the study's B/B_noise = 2: 1.060 ± 0.020" in elsewhere.note
    assert elsewhere.value == pytest.approx(ratio_through_measured(1.06, 2.0, 4.0))
    assert (elsewhere.low, elsewhere.high) == (
        pytest.approx(ratio_through_measured(1.04, 2.0, 4.0)),
        pytest.approx(ratio_through_measured(1.08, 2.0, 4.0)),
    )
    # Where the job's noise scale is unknown: that kappa's worst case, 1 / kappa_eff.
    worst_measured = steps_ratio(kappa, study, unknown)
    assert worst_measured.basis == "worst case"
    assert worst_measured.value == pytest.approx(ratio_through_measured(1.06, 2.0, 1e-12), rel=1e-9)
    # Without the study's noise scale a measurement cannot be placed: printed beside the worst case.
    unplaced = steps_ratio(kappa, MeasuredRatio(1.06, 0.02, 4, 64), job)
    assert unplaced.basis == "model" and "measured at the study's batch" in unplaced.note
    assert steps_ratio(None, None, job).basis == "unknown" and steps_ratio(None, None, job).value == 1.0


def candidate(label: str, params: dict[str, Any], seconds: float) -> Candidate:
    return Candidate(params, 0, seconds, 1, seconds, 0.0, label)


VOTE = candidate("1-bit vote", {"compression": "1bit"}, 1.0)
FOUR_BIT = candidate(
    "4-bit L1", {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"}, 1.5
)
UNSTUDIED = candidate("4-bit L1 all-reduce", {"compression": "kbit", "bits": 4, "quantizer": "l1"}, 2.5)
EXACT = candidate("exact Lion", {"compression": "none"}, 3.0)
CANDIDATES = (VOTE, FOUR_BIT, UNSTUDIED, EXACT)


def cell(mode: str, workers: int, gap: float, kappa: float | None, beta2: float = 0.99) -> StudyCell:
    worth = None if kappa is None else Kappa(kappa, kappa - 0.05, min(1.0, kappa + 0.05))
    return StudyCell(mode, workers, beta2, gap, half_width_percent=0.5, seeds=8, kappa=worth)


CELLS = (cell("1bit", 32, 3.0, 0.5), cell("4bit-l1-alltoall", 32, 8.0, 1.0))


def first_by_hand(job: JobBatch) -> Candidate:
    """The ranking written as a loop: (step + the job's compute) x r, r from each candidate's kappa (1 for exact
    Lion and the unstudied)."""
    kappas = {"1-bit vote": 0.5, "4-bit L1": 1.0}
    best, best_time = None, math.inf
    for c in CANDIDATES:
        kappa = kappas.get(c.label)
        if kappa is None:
            r = 1.0
        elif job.ratio is None:
            r = 1 / kappa
        else:
            r = steps_to_loss(kappa * job.ratio, 1.0) / steps_to_loss(job.ratio, 1.0)
        time = (c.seconds_per_step + job.compute_seconds) * r
        if time < best_time:
            best, best_time = c, time
    assert best is not None
    return best


@pytest.mark.parametrize("compute", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("ratio", [None, 0.5, 1.0, 2.0, 100.0])
def test_the_first_to_lions_loss_is_recommended_and_only_faster_ones_are_passed_over(
    ratio: float | None, compute: float
) -> None:
    job = JobBatch(compute_seconds=compute) if ratio is None else JobBatch(ratio * 1000, 1000, compute)
    choice = choose(CANDIDATES, Cluster(1, 32), 0.99, CELLS, job=job)
    assert choice.best is first_by_hand(job)
    assert [c for c, _ in choice.skipped] == [
        c for c in CANDIDATES if c.seconds_per_step < choice.best.seconds_per_step
    ]
    # 4-bit L1's gap (+8%) is far above 2%, but it is worth the whole batch: it is never passed over for its gap.
    assert choice.verdicts[1].loses and choice.ratio_of(FOUR_BIT).value == 1.0
    assert choice.ratio_of(UNSTUDIED).basis == "unknown" and choice.ratio_of(EXACT).basis == "exact"


def test_the_worst_case_passes_over_the_vote_and_a_large_batch_does_not() -> None:
    worst = choose(CANDIDATES, Cluster(1, 32), 0.99, CELLS)  # the vote 1 s x 2 = 2 s, 4-bit L1 1.5 s
    assert worst.best is FOUR_BIT and [c for c, _ in worst.skipped] == [VOTE]
    lines = worst.skipped_lines()
    assert lines[0].startswith("Faster per step but later to exact Lion's loss than 4-bit L1 (1.5 s x r 1.00")
    assert f"evidence: the convergence study ({SHIPPED_STUDY})" in lines[0]
    assert lines[1].startswith("  1-bit vote: 1 s x r 2.00 [1.82, 2.22] = 2 s [1.82 s, 2.22 s]; loss vs Lion +3.0%")
    large = choose(CANDIDATES, Cluster(1, 32), 0.99, CELLS, job=JobBatch(100_000, 1000))  # r = 1.0099
    assert large.best is VOTE and not large.skipped and large.ratio_of(VOTE).basis == "model"


def test_the_compute_per_step_is_paid_r_times_and_can_change_the_pick() -> None:
    """At B/B_noise = 2 the vote needs r = 4/3: 1 s x 4/3 beats 4-bit L1's 1.5 s, but with 1 s of forward and
    backward a step, 2 s x 4/3 = 2.67 s loses to 2.5 s."""
    alone = choose(CANDIDATES, Cluster(1, 32), 0.99, CELLS, job=JobBatch(2000, 1000))
    assert alone.best is VOTE and alone.seconds_to_loss(VOTE) == pytest.approx(4 / 3)
    with_compute = choose(CANDIDATES, Cluster(1, 32), 0.99, CELLS, job=JobBatch(2000, 1000, 1.0))
    assert with_compute.best is FOUR_BIT and with_compute.seconds_to_loss(VOTE) == pytest.approx(2 * 4 / 3)
    assert with_compute.seconds_to_loss(EXACT) == pytest.approx(4.0)
    assert with_compute.time_text(VOTE).startswith("2 s x r 1.33")


def test_clip_and_no_clip_are_judged_at_the_same_worker_count() -> None:
    """The study measured clip at 8-64 workers, the plain vote at 4 too (another study): at 4 voters both take 8."""
    cells = (
        cell("1bit", 4, 0.9, None),
        cell("1bit", 8, 3.4, 0.65),
        cell("1bit+clip", 8, 2.3, 0.76),
        cell("1bit", 32, 6.1, 0.49),
        cell("1bit+clip", 32, 2.0, 0.78),
    )
    plain = assess({"compression": "1bit"}, 4, 0.99, cells)
    clipped = assess({"compression": "1bit", "clip": {"max_norm": 1.0}}, 4, 0.99, cells)
    assert plain.cell is cells[1] and clipped.cell is cells[2]
    # Where the two share no count, each its own (a mode without a clip twin keeps all its counts).
    alone = (cell("1bit", 4, 0.9, None), cell("1bit+clip", 8, 2.3, 0.76))
    assert assess({"compression": "1bit"}, 4, 0.99, alone).cell is alone[0]
    two_bit = (cell("2bit-l1-alltoall", 4, 13.0, 0.2),)
    l1 = {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"}
    assert assess(l1, 4, 0.99, two_bit).cell is two_bit[0]


def test_another_beta2_is_said_plainly_and_kappa_comes_from_the_nearest_beta2_that_has_one() -> None:
    cells = (cell("1bit", 32, 3.1, None, beta2=0.95), cell("1bit", 32, 6.1, 0.49, beta2=0.99))
    choice = choose((VOTE, EXACT), Cluster(1, 32), 0.9, cells)
    assert choice.verdicts[0].cell is cells[0] and choice.verdicts[0].ratio_cell is cells[1]
    assert choice.study_notes() == [
        "beta2 0.9 is not in the study: each mode is judged by its cells at the nearest beta2 the study has for it "
        "(0.95).",
        "kappa from beta2 0.99's cells (the study has no batch share at beta2 0.95).",
    ]
    assert choice.ratio_of(VOTE).value == pytest.approx(1 / 0.49)
    assert choose((VOTE, EXACT), Cluster(1, 32), 0.99, cells).study_notes() == []


def test_the_shipped_study_is_what_its_description_says() -> None:
    from ds_lioncub.simulate.tasks.gpt_task import GPTTask

    task = GPTTask()
    params = sum(p.numel() for p in task.build_model(0).parameters())
    assert params == 467_584 and f"{params / 1e6:.2f}M" in SHIPPED_STUDY
    assert f"{task.global_batch_size * task.seq_len:,}-token batches" in SHIPPED_STUDY  # byte-level: a byte a token
    assert f"{task.global_batch_size} windows of {task.seq_len} bytes" in SHIPPED_STUDY
    source = json.loads((REPO / "ds_lioncub" / "planner" / "convergence_evidence.json").read_text())["source"]
    assert "300steps" in source and "300 steps" in SHIPPED_STUDY


def test_the_json_is_all_of_stdout_without_ds_accelerator(tmp_path: Path) -> None:
    """A new user's shell has no DS_ACCELERATOR: DeepSpeed then logs its accelerator choice while it is imported.
    That goes to stderr; stdout is the JSON alone. DeepSpeed's logs after the import still go to stdout."""
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    command = [sys.executable, "-m", "ds_lioncub.planner", "--params", "1e8", "--nodes", "2", "--gpus-per-node", "2"]
    command += ["--inter-node-bandwidth", "1gbit", "--device", "cpu", "--json"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) >= {"recommended", "candidates"}
    after = "import ds_lioncub\nfrom deepspeed.utils import logger\nlogger.warning('after the import')\n"
    logged = subprocess.run(
        [sys.executable, "-c", after], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert "after the import" in logged.stdout and "after the import" not in logged.stderr


def test_the_noise_scale_gives_the_model_and_needs_the_batch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    evidence = tmp_path / "study.json"
    row = {"mode": "1bit+clip", "workers": 4, "beta2": 0.99, "gap_percent": 2.0, "half_width_percent": 0.5}
    row.update(seeds=8, kappa=0.7, kappa_low=0.6, kappa_high=0.8)
    evidence.write_text(json.dumps({"source": "made up", "cells": [row]}))
    args = ["--params", "1.5e9", "--nodes", "4", "--gpus-per-node", "8", "--inter-node-bandwidth", "1gbit"]
    args += ["--device", "cpu", "--convergence-evidence", str(evidence)]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--noise-scale", "4096"])
    assert exit_info.value.code == 2 and "--noise-scale needs --global-batch" in capsys.readouterr().err
    assert main([*args, "--global-batch", "8192", "--noise-scale", "4096", "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["time_to_loss"]["global_batch"] == 8192 and output["time_to_loss"]["noise_scale"] == 4096
    recommended = output["recommended"]
    assert recommended["r_basis"] == "model"
    by_hand = steps_to_loss(0.7 * 8192, 4096) / steps_to_loss(8192, 4096)  # (1 + 1/1.4) / 1.5
    assert recommended["r"] == pytest.approx(by_hand)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "r: the worst case, 1/kappa (the job's noise scale is not known" in table


def test_the_jobs_own_cells_take_the_place_of_the_studys_and_give_r_below_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A simulation of the job's own task measured the vote beating exact Lion in steps (r 0.87 at 4 workers, at
    B/B_noise = 16/8 = 2): at the job's own B/B_noise the planner takes r as measured; at another, the model through
    the kappa that gives 0.87 there; the other modes keep the study's cells."""
    own = tmp_path / "own.json"
    cell = {"mode": "1bit", "workers": 4, "beta2": 0.99, "gap_percent": -2.0, "half_width_percent": 1.0, "seeds": 4}
    cell.update(r=0.87, r_half_width=0.03, r_seeds=4, r_batch_samples=16, r_noise_scale_samples=8.0)
    own.write_text(json.dumps({"source": "simulate", "cells": [cell]}))
    args = ["--params", "1.3e7", "--nodes", "4", "--gpus-per-node", "1", "--inter-node-bandwidth", "1gbit"]
    args += ["--device", "cpu", "--clip", "0", "--json", "--global-batch", "16"]

    def vote(extra: list[str]) -> dict[str, Any]:
        assert main([*args, *extra]) == 0
        output = json.loads(capsys.readouterr().out)
        [found] = [c for c in output["candidates"] if c["params"] == {"compression": "1bit"} and c["zero_stage"] == 0]
        found["evidence"] = output["time_to_loss"]["evidence"]
        return found

    at_own = vote(["--noise-scale", "8", "--job-evidence", str(own)])
    assert (at_own["r_basis"], at_own["r"], at_own["gap_percent"]) == ("measured", 0.87, -2.0)
    assert (at_own["r_low"], at_own["r_high"]) == (pytest.approx(0.84), pytest.approx(0.90))
    assert f"with your job's own cells from {own} (1bit at 4 workers)" in at_own["evidence"]
    elsewhere = vote(["--noise-scale", "32", "--job-evidence", str(own)])  # B/B_noise 0.5
    assert elsewhere["r_basis"] == "model" and elsewhere["r"] < 1
    assert elsewhere["r"] == pytest.approx(ratio_through_measured(0.87, 2.0, 0.5), rel=1e-6)
    shipped = vote(["--noise-scale", "8"])  # without the job's cells: the study's, r >= 1
    assert shipped["r"] >= 1 and "own cells" not in shipped["evidence"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cells": [{"mode": "1bit"}]}))
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--job-evidence", str(bad)])
    assert exit_info.value.code == 2 and "--job-evidence: cell 0 of" in capsys.readouterr().err
