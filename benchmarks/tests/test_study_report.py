"""The convergence study's report leaves out runs that trained another task (their first loss differs)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.study_report import load_runs, runs_on_other_data


def _write_run(directory: Path, name: str, seed: int, first_loss: float) -> None:
    record = {"beta2": 0.95, "workers": 32, "mode": name.split("_b2")[0].split("_", 1)[1], "seed": seed}
    record["train_losses"] = [first_loss, first_loss - 0.1]
    (directory / f"{name}_seed{seed}.json").write_text(json.dumps(record))


def test_a_run_whose_first_loss_differs_from_its_seeds_others_is_left_out(tmp_path: Path) -> None:
    _write_run(tmp_path, "N32_exact_b2-0.95", 0, 5.5321)
    _write_run(tmp_path, "N32_2bit_l1_a2a_b2-0.95", 0, 5.5321)
    _write_run(tmp_path, "N32_2bit_l1_a2a_ef21_b2-0.95", 0, 5.5151)  # another corpus
    _write_run(tmp_path, "N32_2bit_l1_a2a_ef21_b2-0.95", 1, 5.6001)  # seed 1: alone, so it is the usual
    assert runs_on_other_data(tmp_path) == ["N32_2bit_l1_a2a_ef21_b2-0.95_seed0.json"]
    cells = load_runs(tmp_path)
    assert sorted(cells[(0.95, 32, "2bit_l1_a2a_ef21")]) == [1]
    assert sorted(cells[(0.95, 32, "exact")]) == [0]
