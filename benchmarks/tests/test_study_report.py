"""The convergence study's report: it leaves out runs that trained another task (their first loss differs), and
sets the bf16 residual beside the fp32 residual."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.study_report import load_runs, runs_on_other_data, storage_table


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


def _write_val(directory: Path, mode: str, seed: int, val_loss: float) -> None:
    record = {"beta2": 0.99, "workers": 64, "mode": mode, "seed": seed, "val_loss": val_loss}
    record["train_losses"] = [5.5, 5.0]
    (directory / f"N64_{mode}_b2-0.99_seed{seed}.json").write_text(json.dumps(record))


def test_the_storage_table_sets_the_bf16_residuals_gap_beside_the_fp32_residuals(tmp_path: Path) -> None:
    for seed, (exact, fp32, bf16) in enumerate([(2.0, 2.2, 2.24), (2.0, 2.1, 2.1), (1.0, 1.2, 1.2)]):
        _write_val(tmp_path, "exact", seed, exact)
        _write_val(tmp_path, "2bit_l1_a2a_ef_residual", seed, fp32)
        _write_val(tmp_path, "2bit_l1_a2a_ef_residual_bf16", seed, bf16)
    _write_val(tmp_path, "4bit_l1_a2a_ef_residual_bf16", 0, 1.0)  # no fp32 residual run: no row
    table = storage_table(load_runs(tmp_path), [0.99])
    rows = [line for line in table.splitlines() if line.startswith("| 0.99")]
    assert len(rows) == 1, table
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # gaps per seed: fp32 10, 5, 20 (mean 11.67); bf16 12, 5, 20 (mean 12.33); bf16 - fp32: 2, 0, 0 (mean 0.67)
    assert cells[:4] == ["0.99", "64", "2-bit L1 a2a + EF residual (bf16)", "3"]
    assert cells[4].startswith("+11.67") and cells[5].startswith("+12.33") and cells[6].startswith("+0.67"), cells
    # bf16 - fp32: deviations 4/3, -2/3, -2/3 from the mean, sample sd sqrt(4/3); the 95% half-width
    # t(2) x sd / sqrt 3 = 4.303 x 2/3 = 2.87 (t(2) = 0.95 sqrt(2 / (1 - 0.95^2)), its closed form).
    t2 = 0.95 * math.sqrt(2 / (1 - 0.95**2))
    assert cells[6] == f"+0.67 ± {t2 * math.sqrt(4 / 3) / math.sqrt(3):.2f}" == "+0.67 ± 2.87"
