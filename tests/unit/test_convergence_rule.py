"""The planner's and "auto"'s rule: the candidate first to exact Lion's loss (step time x r) is recommended, a
faster one is passed over only for it, never for its gap after a fixed number of steps alone, and the gap stays
in the output beside r.

The cells here are made up for the test (the shipped study is benchmarks/RESULTS.md's); each check
states what the rule must do with them, independently of how the planner prices the modes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner import auto as auto_module
from ds_lioncub.planner.auto import resolve_auto
from ds_lioncub.planner.convergence import StudyCell, assess, choose, study_mode, voters
from ds_lioncub.planner.model import Cluster, Network, plan
from ds_lioncub.planner.time_to_loss import Kappa
from ds_lioncub.quantities.units import format_seconds

REPO = Path(__file__).resolve().parents[2]
GBIT = 1e9 / 8  # bytes per second


def cell(
    mode: str,
    workers: int,
    gap: float,
    half_width: float | None,
    beta2: float = 0.99,
    seeds: int = 3,
    kappa: float | None = None,
) -> StudyCell:
    """A study cell; with ``kappa``, worth that share of the batch (interval kappa x 0.9 to x 1.1, at most 1)."""
    worth = None if kappa is None else Kappa(kappa, 0.9 * kappa, min(1.0, 1.1 * kappa))
    return StudyCell(mode, workers, beta2, gap, half_width_percent=half_width, seeds=seeds, kappa=worth)


def as_file(*cells: StudyCell) -> dict:
    """An evidence file's JSON for ``cells`` (their kappa written out as the file's fields)."""
    out = []
    for c in cells:
        row = {k: v for k, v in c.__dict__.items() if k not in ("kappa", "measured_ratio")}
        if c.kappa is not None:
            row.update(kappa=c.kappa.value, kappa_low=c.kappa.low, kappa_high=c.kappa.high)
        out.append(row)
    return {"source": "made up for this test", "cells": out}


def test_modes_map_to_the_study_keys_they_compute() -> None:
    assert study_mode({"compression": "none"}) is None
    assert study_mode({"compression": "1bit"}) == "1bit"
    # A k-bit vote of sign fields sums the same signs with the same tie rule: the 1-bit vote's evidence.
    for bits in (2, 4, 8):
        for algorithm in ("allreduce", "alltoall"):
            assert study_mode({"compression": "kbit", "bits": bits, "kbit_algorithm": algorithm}) == "1bit"
    assert study_mode({"compression": "kbit", "bits": 8, "quantizer": "l1"}) == "8bit-l1-allreduce"
    assert study_mode({"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"}) == (
        "2bit-l1-alltoall"
    )
    assert study_mode({"compression": "kbit", "bits": 4, "aggregation": "mean"}) == "unmeasured"
    assert study_mode({"compression": "1bit", "momentum_sync": {"interval": 10, "layers": "auto"}}) == "1bit+sync"
    assert study_mode({"compression": "1bit", "momentum_sync": {"interval": 50, "layers": "auto"}}) == "1bit"


def test_a_worker_count_takes_the_next_studied_count_and_beta2_the_nearest() -> None:
    cells = (
        cell("1bit", 8, 0.5, 1.0),
        cell("1bit", 32, 4.0, 1.0),
        cell("1bit", 8, 9.0, 1.0, beta2=0.95),
    )
    assert assess({"compression": "1bit"}, 8, 0.99, cells).cell == cells[0]
    assert assess({"compression": "1bit"}, 9, 0.99, cells).cell == cells[1]  # between 8 and 32: 32's
    assert assess({"compression": "1bit"}, 2, 0.99, cells).cell == cells[0]
    beyond = assess({"compression": "1bit"}, 100, 0.98, cells)
    assert beyond.cell == cells[1] and "the study's largest (you have 100)" in beyond.note
    assert assess({"compression": "1bit"}, 8, 0.96, cells).cell == cells[2]
    assert assess({"compression": "kbit", "aggregation": "mean"}, 8, 0.99, cells).cell is None
    assert not assess({"compression": "none"}, 8, 0.99, cells).loses


@pytest.mark.parametrize(
    ("gap", "half_width", "loses", "undecided"),
    [
        (3.0, 0.9, True, False),  # [2.1, 3.9]: above 2
        (3.0, 1.0, False, True),  # [2.0, 4.0]: the lower end at 2, not above it
        (3.3, 3.0, False, True),  # [0.3, 6.3]: holds 2, too wide to tell
        (1.9, 0.1, False, True),  # [1.8, 2.0]: reaches 2
        (1.0, 0.9, False, False),  # [0.1, 1.9]: below 2, within the threshold
        (-4.0, 1.0, False, False),
        (5.0, None, False, True),  # no interval
    ],
)
def test_a_mode_loses_only_when_its_interval_lies_above_the_threshold(
    gap: float, half_width: float | None, loses: bool, undecided: bool
) -> None:
    assert cell("1bit", 8, gap, half_width).loses is loses
    assert cell("1bit", 8, gap, half_width).undecided is undecided
    assert not cell("1bit", 8, gap, half_width, seeds=2).loses  # an interval of two seeds says too little
    assert cell("1bit", 8, gap, half_width, seeds=2).undecided is (loses or undecided)


def test_a_faster_mode_is_passed_over_only_for_one_that_reaches_lions_loss_sooner() -> None:
    cluster = Cluster(4, 8)
    candidates = plan(1_500_000_000, cluster, Network(GBIT, None, 50e-6))
    fastest = candidates[0]
    assert fastest.compression != "none" and fastest.zero_stage == 2  # the ZeRO-2 hybrid: the 4 nodes vote
    key = study_mode(fastest.params)
    assert key is not None
    # A large gap after the study's steps but worth 0.9 of the batch (r at most 1/0.9): still first to the loss.
    keeps = choose(candidates, cluster, 0.99, (cell(key, 4, 6.0, 1.0, kappa=0.9),))
    assert keeps.best is fastest and not keeps.skipped and keeps.verdicts[0].loses  # the gap alone decides nothing
    # Worth so little that every other mode, r unknown here (ranked by its step), gets there first.
    worthless = choose(candidates, cluster, 0.99, (cell(key, 4, 6.0, 1.0, kappa=0.05),))
    time = fastest.seconds_per_step / 0.05
    by_hand = min(
        candidates, key=lambda c: c.seconds_per_step / 0.05 if study_mode(c.params) == key else c.seconds_per_step
    )
    assert worthless.best is by_hand and worthless.best.seconds_per_step < time
    assert worthless.skipped[0][0] is fastest
    assert all(c.seconds_per_step < by_hand.seconds_per_step for c, _ in worthless.skipped)
    # Judged at 32 voters (stage 0) the same mode would take 32's cell: the hybrid's is the nodes'.
    assert voters(fastest, cluster) == 4 and voters(candidates[-1], cluster) in (4, 32)


def test_the_cli_names_what_it_passed_over_one_line_each_in_the_table_and_the_json(tmp_path: Path) -> None:
    # 4 nodes x 8 ranks at 1 Gbit/s: the 1-bit vote under the ZeRO-2 hybrid is fastest per step (32 -> 4 voters).
    # The command line plans compressed modes with the mean clip, so the cell that judges every sign vote is the
    # one with clip: here worth a tenth of the batch, r = 10 in the worst case.
    evidence = tmp_path / "study.json"
    evidence.write_text(json.dumps(as_file(cell("1bit+clip", 4, 7.5, 2.0, kappa=0.1))))
    base = [sys.executable, "-m", "ds_lioncub.planner", "--params", "1.5e9", "--nodes", "4", "--gpus-per-node", "8"]
    base += ["--inter-node-bandwidth", "1gbit", "--convergence-evidence", str(evidence)]
    table = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = table.splitlines()
    recommended = next(i for i, line in enumerate(lines) if line.startswith("Recommended:"))
    assert "sign vote" not in lines[recommended] and "1-bit" not in lines[recommended]
    header = next(i for i, line in enumerate(lines) if line.startswith("Faster per step but later"))
    assert f"evidence: the convergence study in {evidence}" in lines[header]
    passed = []
    for line in lines[header + 1 :]:
        if not line.startswith("  "):
            break
        passed.append(line)
    # One line per mode passed over, each with its step x r and its gap.
    assert passed[0].startswith("  1-bit vote + clip, ZeRO-2 hybrid: ") and " x r 10.00 [" in passed[0]
    assert passed[0].endswith("loss vs Lion +7.5% (95% CI +5.5 to +9.5, 3 seeds) at 4 workers, beta2 0.99")
    assert len(passed) >= 2 and all(": " in line for line in passed)
    output = json.loads(subprocess.run([*base, "--json"], cwd=REPO, capture_output=True, text=True, check=True).stdout)
    first = output["passed_over"][0]
    assert {key: first[key] for key in ("gap_percent", "half_width_percent", "seeds")} == {
        "gap_percent": 7.5,
        "half_width_percent": 2.0,
        "seeds": 3,
    }
    assert first["r"] == pytest.approx(10.0) and first["why"].startswith("later to exact Lion's loss: ")
    assert study_mode(output["recommended"]["params"]) != "1bit+clip"
    parse_config(output["recommended"]["params"])


def _patched(monkeypatch: pytest.MonkeyPatch, cells: tuple[StudyCell, ...]) -> None:
    monkeypatch.setattr(
        auto_module,
        "choose",
        lambda c, cl, b2, momentum_sync=None, job=None: choose(c, cl, b2, cells, momentum_sync, job),
    )


def test_auto_takes_the_mode_first_to_lions_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    options = parse_config({"compression": "auto", "network": {"bandwidth": "1gbit"}, "betas": [0.9, 0.95]})
    _patched(monkeypatch, (cell("1bit", 32, 4.0, 1.0, beta2=0.95, kappa=0.9),))  # a gap, but r <= 1/0.9
    plain = resolve_auto(options, 1_500_000_000, 32, 1)
    assert study_mode(plain.options.model_dump()) == "1bit" and not plain.fell_back
    assert "to exact Lion's loss" in plain.sentence and "worst case 1/kappa" in plain.sentence
    assert "loss vs Lion after the study's steps: +4.0% (95% CI +3.0 to +5.0, 3 seeds)" in plain.sentence
    _patched(monkeypatch, (cell("1bit", 32, 4.0, 1.0, beta2=0.95, kappa=0.05),))  # r = 20: others come first
    resolved = resolve_auto(options, 1_500_000_000, 32, 1)
    assert study_mode(resolved.options.model_dump()) != "1bit"
    assert resolved.fell_back and "Faster per step but later to exact Lion's loss" in resolved.sentence
    assert "1-bit vote: " in resolved.sentence and " x r 20.00 [" in resolved.sentence


def test_auto_says_when_no_faster_mode_reaches_lions_loss_sooner(monkeypatch: pytest.MonkeyPatch) -> None:
    options = parse_config({"compression": "auto", "network": {"bandwidth": "1gbit"}})
    modes = ("1bit", "2bit-l1-alltoall", "4bit-l1-alltoall", "8bit-l1-allreduce", "8bit-l1-alltoall")
    modes += ("2bit-l1-allreduce", "4bit-l1-allreduce")
    _patched(monkeypatch, tuple(cell(mode, 64, 9.0, 1.0, kappa=0.06) for mode in modes))  # r = 16.7 for each
    resolved = resolve_auto(options, 1_500_000_000, 32, 1)
    exact = next(c for c in resolved.candidates if c.compression == "none")
    assert all(
        c.seconds_per_step / 0.06 > exact.seconds_per_step for c in resolved.candidates if c.compression != "none"
    )
    assert resolved.options.compression == "none" and resolved.fell_back
    assert "compression would pay per step" in resolved.sentence
    assert "no faster mode reaches exact Lion's loss sooner" in resolved.sentence
    assert "does not pay" not in resolved.sentence


def test_the_recommendations_gap_is_shown_beside_its_r_in_the_cli_and_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 1-bit vote with the command line's default mean clip at 4 voters (the ZeRO-2 hybrid of 4 nodes), +3.3
    # [+0.3, +6.3], worth 0.75 of the batch: first to the loss, its gap printed under it.
    evidence = tmp_path / "study.json"
    evidence.write_text(json.dumps(as_file(cell("1bit+clip", 4, 3.3, 3.0, kappa=0.75))))
    base = [sys.executable, "-m", "ds_lioncub.planner", "--params", "1.5e9", "--nodes", "4", "--gpus-per-node", "8"]
    base += ["--inter-node-bandwidth", "1gbit", "--convergence-evidence", str(evidence)]
    table = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = table.splitlines()
    recommended = next(i for i, line in enumerate(lines) if line.startswith("Recommended:"))
    assert lines[recommended].startswith("Recommended: 1-bit vote + clip, ZeRO-2 hybrid,")
    assert " x r 1.33 [1.21, 1.48] = " in lines[recommended]  # 1/0.75 [1/0.825, 1/0.675]
    assert lines[recommended + 1].startswith("  r: worst case 1/kappa (the job's noise scale unknown), kappa 0.75")
    assert lines[recommended + 2] == (
        "  loss vs Lion after the study's steps: +3.3% (95% CI +0.3 to +6.3, 3 seeds) at 4 workers, beta2 0.99."
    )
    assert "+3.3 [+0.3, +6.3]" in table and "Faster per step" not in table
    output = json.loads(subprocess.run([*base, "--json"], cwd=REPO, capture_output=True, text=True, check=True).stdout)
    assert output["recommended"]["uncertain_loss"] == {
        "gap_percent": 3.3,
        "half_width_percent": 3.0,
        "seeds": 3,
        "why": "1-bit vote + clip, ZeRO-2 hybrid: loss vs Lion +3.3% (95% CI +0.3 to +6.3, 3 seeds) at 4 workers, "
        "beta2 0.99: not shown to exceed 2%, nor to stay below it.",
    }
    assert "passed_over" not in output
    # "auto" at 32 ranks of one node each (32 voters), beta2 0.95: the gap in its log line too.
    options = parse_config({"compression": "auto", "network": {"bandwidth": "1gbit"}, "betas": [0.9, 0.95]})
    _patched(monkeypatch, (cell("1bit", 32, 3.3, 3.0, beta2=0.95, kappa=0.75),))
    resolved = resolve_auto(options, 1_500_000_000, 32, 1)
    assert study_mode(resolved.options.model_dump()) == "1bit" and not resolved.fell_back
    assert resolved.sentence.endswith(
        "loss vs Lion after the study's steps: +3.3% (95% CI +0.3 to +6.3, 3 seeds) at 32 workers, beta2 0.95)."
    )


def test_auto_judges_a_compressed_mode_with_the_users_momentum_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = {"interval": 10, "layers": "auto"}
    options = parse_config({"compression": "auto", "network": {"bandwidth": "1gbit"}, "momentum_sync": sync})
    # Plain 1-bit loses at 32 workers, 1-bit with the head's momentum synced does not.
    cells = (cell("1bit", 32, 5.0, 1.0, kappa=0.05), cell("1bit+sync", 32, 0.5, 1.0, kappa=0.95))
    _patched(monkeypatch, cells)
    resolved = resolve_auto(options, 1_500_000_000, 32, 1)
    assert study_mode(resolved.options.model_dump()) == "1bit+sync" and not resolved.fell_back


def test_a_malformed_evidence_file_exits_2_naming_the_cell(tmp_path: Path) -> None:
    evidence = tmp_path / "study.json"
    evidence.write_text(json.dumps({"cells": [{**cell("1bit", 4, 1.0, 0.5).__dict__, "workers": "4"}]}))
    command = [sys.executable, "-m", "ds_lioncub.planner", "--params", "1e6", "--nodes", "2", "--gpus-per-node", "1"]
    command += ["--inter-node-bandwidth", "1gbit", "--convergence-evidence", str(evidence)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "cell 0" in done.stderr and "Traceback" not in done.stderr


def test_auto_ranks_at_the_jobs_batch_over_its_noise_scale_with_its_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Option job gives "auto" the planner's --global-batch, --noise-scale and --compute-per-step; r is then the
    model's at B/B_noise, written out here from S = S_min (1 + B_noise / B), and job is not kept in the options."""
    _patched(monkeypatch, (cell("1bit", 32, 4.0, 1.0, beta2=0.95, kappa=0.5),))
    base = {"compression": "auto", "network": {"bandwidth": "1gbit"}, "betas": [0.9, 0.95]}
    job = {"global_batch": 4096, "noise_scale": 1024, "compute_per_step": "2s"}
    resolved = resolve_auto(parse_config({**base, "job": job}), 1_500_000_000, 32, 1)
    assert study_mode(resolved.options.model_dump()) == "1bit" and "job" not in resolved.options.model_fields_set
    by_hand = (1 + 1024 / (0.5 * 4096)) / (1 + 1024 / 4096)  # 1.2, against the worst case 1 / 0.5 = 2
    assert "model at B/B_noise = 4, kappa 0.50" in resolved.sentence and f" x r {by_hand:.2f}" in resolved.sentence
    vote = next(c for c in resolved.candidates if c.compression == "1bit")
    step = vote.seconds_per_step + 2.0  # the compute is in every step, and paid r times
    assert f"= {format_seconds(step * by_hand)}" in resolved.sentence
    worst = resolve_auto(parse_config(base), 1_500_000_000, 32, 1)
    assert "1-bit vote: " in worst.sentence and " x r 2.00 [" in worst.sentence  # without job: 1 / kappa, passed over
    with pytest.raises(LionCubConfigError, match="noise_scale needs global_batch"):
        parse_config({**base, "job": {"noise_scale": 1024}})
