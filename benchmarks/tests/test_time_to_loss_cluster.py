"""benchmarks/time_to_loss_cluster.py: the arithmetic between the runs and the table (steps to L*, r, seconds per
step, time to L*, the ratio against exact fp32 Lion, the planner's predicted ratio), on records written here with
numbers chosen so that every figure is worked out by hand below. No cluster, no timing."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from benchmarks import REPO
from benchmarks.time_to_loss_cluster import (
    EXACT_BF16,
    EXACT_FP32,
    PICK,
    PlannerView,
    RunSpec,
    analyse,
    lengths,
    mode_time,
    parts_lines,
    pick_method,
    planner_view,
    prediction_lines,
    run_order,
    seconds_per_step,
    table_lines,
    target_lines,
    within,
)
from benchmarks.train_methods import METHODS_BY_NAME, TrainSettings, ds_config, method_from_json


def record(
    mode: str, steps: int, val: float, step_s: float, compute_s: float = 0.0, first: float = 5.5
) -> dict[str, Any]:
    """train_worker's record of a run: ``steps`` steps of ``step_s`` seconds, half of ``compute_s`` forward, its
    first training loss ``first`` (the same data and weights as exact Lion's where it is 5.5)."""
    return {
        "run_mode": mode,
        "steps": steps,
        "val_loss": val,
        "per_step": {
            "total_s": [step_s] * steps,
            "forward_s": [compute_s / 2] * steps,
            "backward_s": [compute_s / 2] * steps,
            "loss": [first] * steps,
        },
    }


def answer(r: float = 1.5) -> dict[str, Any]:
    """A planner --json answer: the 1-bit vote at 0.3 s x r recommended; exact fp32 0.9 s, bf16 0.6 s at stage 0."""
    vote = {"params": {"compression": "1bit"}, "zero_stage": 0, "seconds_per_step": 0.3}
    return {
        "recommended": {
            "params": {"compression": "1bit"},
            "zero_stage": 0,
            "r": r,
            "r_low": 1.4,
            "r_high": 1.6,
            "r_basis": "worst case",
            "seconds_to_lions_loss": 0.3 * r,
        },
        "local_costs": {"device": "cpu", "measured_on": "here"},
        "time_to_loss": {"noise_scale": None},
        "candidates": [
            vote,
            {"params": {"compression": "none", "comm_dtype": "bf16"}, "zero_stage": 0, "seconds_per_step": 0.6},
            {"params": {"compression": "none"}, "zero_stage": 2, "seconds_per_step": 0.7},
            {"params": {"compression": "none"}, "zero_stage": 0, "seconds_per_step": 0.9},
        ],
    }


def test_the_planner_answer_is_read_and_its_ratio_worked_out() -> None:
    view = planner_view(answer())
    assert view.pick_params == {"compression": "1bit"} and view.pick_zero_stage == 0
    assert (view.pick_step_s, view.exact_fp32_step_s, view.exact_bf16_step_s) == (0.3, 0.9, 0.6)  # stage 0, not 2
    assert view.r == 1.5 and view.pick_to_loss_s == pytest.approx(0.45)
    # The planner alone: 0.9 / (0.3 x 1.5) = 2; with 0.5 s of forward and backward in every step:
    # (0.5 + 0.9) / ((0.5 + 0.3) x 1.5) = 1.4 / 1.2.
    assert view.predicted_ratio() == pytest.approx(2.0)
    assert view.predicted_ratio(0.5) == pytest.approx(1.4 / 1.2)
    assert pick_method(view).lioncub == {"compression": "1bit"}


def test_a_pick_under_zero_is_refused() -> None:
    view = PlannerView({"compression": "1bit"}, 2, 1.0, None, None, "", 0.1, 0.1, 0.2, None, None, "")
    with pytest.raises(SystemExit, match="ZeRO stage 2"):
        pick_method(view)


def test_run_lengths_and_both_orders() -> None:
    assert lengths(80, [1.0, 1.25, 1.5]) == [80, 100, 120]
    assert lengths(80, [1.5, 1.0, 1.0]) == [80, 120]
    forward = run_order("exact_first", 80, [1.0, 1.25])
    assert [run.name for run in forward] == ["lion_fp32_80steps", "lion_bf16_80steps", "pick_80steps", "pick_100steps"]
    assert run_order("pick_first", 80, [1.0, 1.25]) == forward[::-1]
    with pytest.raises(ValueError, match="unknown order"):
        run_order("sideways", 80, [1.0])


def test_seconds_per_step_is_the_mean_over_every_step_of_the_runs() -> None:
    runs = [record(PICK, 3, 2.0, 1.0), record(PICK, 1, 2.0, 5.0)]
    assert seconds_per_step(runs) == pytest.approx((3 * 1.0 + 5.0) / 4)


def test_steps_to_the_target_are_interpolated_as_the_study_does() -> None:
    # 2.10 at 80 steps, 1.90 at 100: the target 2.0 halfway, 90 steps, r = 90 / 80.
    found = mode_time(PICK, [record(PICK, 100, 1.90, 0.4), record(PICK, 80, 2.10, 0.4)], 80, 2.0)
    assert found.points == ((80, 2.10), (100, 1.90))
    assert found.steps_to_target == pytest.approx(90.0) and found.r == pytest.approx(1.125)
    assert found.time_to_target == pytest.approx(36.0) and not found.extrapolated
    # Already below at T: on the line through the two shortest runs, 80 - 20 x 0.01 / 0.19 steps.
    below = mode_time(PICK, [record(PICK, 80, 1.99, 0.4), record(PICK, 100, 1.80, 0.4)], 80, 2.0)
    assert below.steps_to_target == pytest.approx(80 - 20 * 0.01 / 0.19) and below.extrapolated
    # Never reached by the longest run: no r, the bound says so.
    above = mode_time(PICK, [record(PICK, 80, 2.3, 0.4), record(PICK, 120, 2.1, 0.4)], 80, 2.0)
    assert (above.r, above.bound, above.time_to_target) == (None, "> 1.50", None)
    # Exact Lion: T steps, r = 1.
    exact = mode_time(EXACT_FP32, [record(EXACT_FP32, 80, 2.0, 1.0)], 80, 2.0)
    assert (exact.steps_to_target, exact.r, exact.time_to_target) == (80.0, 1.0, 80.0)


def order_records() -> dict[str, dict[str, Any]]:
    """fp32 80 steps of 1.0 s to 2.0 (the target); bf16 80 of 0.75 s; the pick 2.10 / 1.90 at 80 / 100 steps of
    0.4 s, 0.25 s of each step forward and backward: L* = 90 steps, 36 s; fp32 80 s: 80 / 36 = 2.22x."""
    runs = [
        record(EXACT_FP32, 80, 2.0, 1.0, 0.5),
        record(EXACT_BF16, 80, 2.001, 0.75, 0.5),
        record(PICK, 80, 2.10, 0.4, 0.25),
        record(PICK, 100, 1.90, 0.4, 0.25),
    ]
    return {f"{run['run_mode']}_{run['steps']}steps": run for run in runs}


def test_an_order_is_analysed_against_exact_fp32_lions_loss() -> None:
    result = analyse("exact_first", order_records(), 80)
    assert result.target == 2.0
    assert result.ratio(EXACT_FP32) == pytest.approx(1.0)
    assert result.ratio(EXACT_BF16) == pytest.approx(80 / 60)
    assert result.ratio(PICK) == pytest.approx(80 / 36)
    assert result.modes[PICK].compute_per_step == pytest.approx(0.25)


def test_runs_of_another_session_join_the_crossing_not_the_timing() -> None:
    # The pick at 80 and 100 steps is already below the target (1.99, 1.80): alone, L* is extrapolated below 80.
    # A 60-step run of another session at 2.09 (0.1 s a step: not this order's timing) brackets it: 60 + 20 x 0.09 /
    # 0.10 = 78 steps, r = 78 / 80, time 78 x 0.4 s. A run on other data (its first loss differs) is left out.
    records = order_records()
    records["pick_80steps"] = record(PICK, 80, 1.99, 0.4, 0.25)
    records["pick_100steps"] = record(PICK, 100, 1.80, 0.4, 0.25)
    alone = analyse("exact_first", records, 80).modes[PICK]
    assert alone.extrapolated and alone.steps_to_target == pytest.approx(80 - 20 * 0.01 / 0.19)
    other = [record(PICK, 60, 2.09, 0.1), record(PICK, 40, 2.5, 0.1, first=5.4), record(EXACT_BF16, 40, 3.0, 0.1)]
    found = analyse("exact_first", records, 80, other).modes[PICK]
    assert found.points == ((60, 2.09), (80, 1.99), (100, 1.80)) and found.loss_only == (60,)
    assert found.steps_to_target == pytest.approx(78.0) and not found.extrapolated
    assert found.seconds_per_step == pytest.approx(0.4) and found.time_to_target == pytest.approx(78 * 0.4)
    table = "\n".join(table_lines([analyse("exact_first", records, 80, other)], "the pick"))
    assert "| 60: 2.0900†, 80: 1.9900, 100: 1.8000 | 78.0 | 0.975 | 31.2 |" in table


def test_within_25_percent_of_the_measured_ratio() -> None:
    assert within(2.0, 1.7)  # 2.0 / 1.7 = 1.18
    assert within(1.5, 2.0)  # 0.75, the edge
    assert not within(2.0, 1.5)  # 1.33
    assert not within(1.0, 2.0)


def test_the_tables_carry_the_hand_computed_figures() -> None:
    result = analyse("exact_first", order_records(), 80)
    table = "\n".join(table_lines([result], "the pick"))
    assert "| exact_first | exact Lion, fp32 all-reduce | 1000 | 80: 2.0000 | 80.0 | 1.000 | 80.0 | 1.00x |" in table
    assert "| exact_first | exact Lion, bf16 all-reduce | 750 | 80: 2.0010 | 80.0 | 1 (T steps; +0.05% vs L*) " in table
    assert "| exact_first | the pick | 400 | 80: 2.1000, 100: 1.9000 | 90.0 | 1.125 | 36.0 | 2.22x |" in table
    lines = prediction_lines([result], {"worst case": planner_view(answer())}, 0.25)
    # The planner alone: 2.00x against 2.22x measured, 0.90 of it (within 25%); with 0.25 s of compute:
    # (0.25 + 0.9) / ((0.25 + 0.3) x 1.5) = 1.39x, 0.63 of the measured (not within).
    assert (
        "| worst case, planner alone | 1.50 [1.40, 1.60] (worst case) | 300 | 900 | 2.00x | 2.22x | 0.90 | yes |"
        in (lines[2])
    )
    assert "| 550 | 1150 | 1.39x | 2.22x | 0.63 | **no** |" in lines[3]
    assert target_lines([result]) == [
        "- exact_first: the pick reaches L* 2.22x sooner than exact fp32 Lion: >= 3x **not met**."
    ]


def test_the_planners_parts_are_set_against_the_measured_ones() -> None:
    # Measured comm + optimizer = step - forward - backward: fp32 1000 - 500 = 500 ms against the planner's 900;
    # bf16 750 - 500 = 250 against 600; the pick 400 - 250 = 150 against 300.
    lines = parts_lines([analyse("exact_first", order_records(), 80)], planner_view(answer()))
    assert lines[2] == "| exact_first | exact Lion, fp32 all-reduce | 900 | 500 | 1.80 | 500 | 1000 |"
    assert lines[3] == "| exact_first | exact Lion, bf16 all-reduce | 600 | 250 | 2.40 | 500 | 750 |"
    assert lines[4] == "| exact_first | the pick | 300 | 150 | 2.00 | 250 | 400 |"


def test_the_cosine_schedule_and_a_method_given_as_json() -> None:
    settings = TrainSettings(schedule="cosine")
    config = ds_config(METHODS_BY_NAME["lion_fp32"], settings, steps=80)
    assert config["scheduler"]["type"] == "WarmupCosineLR"
    assert config["scheduler"]["params"]["total_num_steps"] == 80
    assert config["scheduler"]["params"]["warmup_num_steps"] == 10
    assert "scheduler" not in ds_config(METHODS_BY_NAME["lion_fp32"], TrainSettings())  # bench_train's default
    with pytest.raises(ValueError, match="cosine schedule needs the run's steps"):
        ds_config(METHODS_BY_NAME["lion_fp32"], settings)
    with pytest.raises(ValueError, match="schedule must be one of"):
        TrainSettings(schedule="linear")
    method = METHODS_BY_NAME["lioncub_8bit_l1"]
    assert method_from_json(json.dumps(asdict(method))) == method
    assert RunSpec(PICK, 100).name == "pick_100steps"


def test_the_virtual_worlds_task_is_the_cluster_jobs() -> None:
    """benchmarks/cluster_job_task.py stands for the cluster's job: its model, global batch and validation windows
    are what the cluster run recorded and trained with."""
    from benchmarks.cluster_job_task import cluster_job
    from benchmarks.time_to_loss_cluster import parse_args as cluster_args

    task = cluster_job()
    recorded = json.loads((REPO / "benchmarks/results/time_to_loss_cluster/time_to_loss_cluster.json").read_text())
    assert sum(p.numel() for p in task.build_model(0).parameters()) == recorded["params"] == 12_915_200
    assert task.global_batch_size == recorded["global_batch"] == 16
    assert task.seq_len == recorded["settings"]["seq_len"]
    assert task.eval_windows == cluster_args(["--out-dir", "x"]).eval_windows
    config = json.loads((REPO / "benchmarks/cluster_job_ds_config.json").read_text())
    settings, params = recorded["settings"], config["optimizer"]["params"]
    assert params["lr"] == settings["lr"] and params["weight_decay"] == settings["weight_decay"]
    assert params["betas"] == [settings["beta1"], recorded["pick"]["beta2"]]
    assert params["compression"] == recorded["pick"]["lioncub"]["compression"] and config["gradient_clipping"] == 0


def test_the_simulated_prediction_asks_the_planner_with_the_jobs_cell_and_its_noise_scale(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import time_to_loss_cluster

    evidence = tmp_path / "own.json"
    cells = [
        {"mode": "1bit", "workers": 8, "r_noise_scale_samples": 99.0},
        {"mode": "1bit", "workers": 4, "r_noise_scale_samples": 6.5},
    ]
    evidence.write_text(json.dumps({"cells": cells}))
    asked: list[list[str]] = []
    monkeypatch.setattr(time_to_loss_cluster, "ask_planner", lambda command: asked.append(command) or answer())
    summary = {"params": 1000, "ranks": 4, "bandwidth": "1gbit", "ranks_per_core": 2.0, "global_batch": 16}
    summary["planner"] = {"table": "calibrated", "worst_case": {"answer": answer()}}
    found = time_to_loss_cluster.simulated_answer(summary, tmp_path, evidence)
    [command] = asked
    assert found["command"] == command[1:]
    assert command[command.index("--noise-scale") + 1] == "6.5"  # the 4-rank cell's, the simulation's own
    assert command[command.index("--job-evidence") + 1] == str(evidence)
    assert command[command.index("--local-costs") + 1] == str(tmp_path / "local_costs.json")
    assert command[command.index("--global-batch") + 1] == "16" and command[command.index("--nodes") + 1] == "4"
