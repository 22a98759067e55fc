"""``python -m ds_lioncub.simulate`` end to end on a tiny task: the printed table against separate runs.

The expected gaps are computed here from train_virtual calls made by the test (exact Lion's options
written out by hand) and the arithmetic of the definition (100 x (mode - exact) / exact per seed,
mean, 2 x sample std), not by the CLI's helpers.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from ds_lioncub.simulate.cli import main
from ds_lioncub.simulate.train import train_virtual
from examples.gpt import GPTConfig
from examples.simulate_gpt import GPTTask

TASK = "tests.unit.test_simulate_cli:tiny_task"
MODE = {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "compression": "1bit"}


def tiny_task() -> GPTTask:
    """A 1-layer, d_model 16 GPT on 100 kB of the stdlib corpus, global batch 8 x 16 bytes."""
    return GPTTask(
        name="tiny",
        config=GPTConfig(max_seq_len=16, n_layer=1, n_head=2, d_model=16),
        global_batch_size=8,
        seq_len=16,
        eval_windows=16,
        corpus_bytes=100_000,
        eval_batch=16,
    )


def write_config(path: Path, optimizer: dict) -> Path:
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer": optimizer}))
    return path


def table_rows(out: str) -> dict[int, list[str]]:
    """workers -> the cells of its table line (gap mean and spread split out)."""
    rows = {}
    for line in out.splitlines():
        match = re.match(
            r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+([+-]\d+\.\d+) ± (\S+)\s+(yes|no)\s+(\S+)\s+(\S+)\s+(\S+)$", line
        )
        if match:
            rows[int(match.group(1))] = list(match.groups()[1:])
    return rows


@pytest.mark.slow  # 16 short trainings: 10-70 s on this shared 2-core machine
def test_cli_table_equals_separate_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})
    argv = [str(config), "--workers", "2", "4", "--steps", "4", "--seeds", "0", "1", "--task", TASK]
    assert main(argv) == 0
    rows = table_rows(capsys.readouterr().out)
    assert sorted(rows) == [2, 4]

    task = tiny_task()
    exact = {"compression": "none", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
    for workers, cells in rows.items():
        gaps, exact_vals, mode_vals, matches = [], [], [], []
        for seed in (0, 1):
            e = train_virtual(task, exact, workers, 4, seed)
            m = train_virtual(task, MODE, workers, 4, seed)
            gaps.append(100.0 * (m.val_loss - e.val_loss) / e.val_loss)
            exact_vals.append(e.val_loss)
            mode_vals.append(m.val_loss)
            assert m.agreement is not None
            matches.append(m.agreement.match)
        mean = (gaps[0] + gaps[1]) / 2
        spread = 2 * math.sqrt(sum((g - mean) ** 2 for g in gaps))  # ddof 1 with two seeds
        assert float(cells[0]) == pytest.approx(sum(exact_vals) / 2, abs=5e-5)
        assert float(cells[1]) == pytest.approx(sum(mode_vals) / 2, abs=5e-5)
        assert cells[2] == f"{mean:+.3f}" and cells[3] == f"{spread:.3f}"
        assert cells[4] == ("yes" if abs(mean) > spread else "no")
        assert float(cells[5]) == pytest.approx(sum(matches) / 2, abs=5e-4)


def test_cli_refuses_another_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "adam.json", {"type": "Adam", "params": {"lr": 1e-3}})
    assert main([str(config), "--workers", "2", "--steps", "1", "--seeds", "0", "--task", TASK]) == 2
    err = capsys.readouterr().err
    assert "LionCub: " in err and "'Adam'" in err and '"type": "LionCub"' in err


def test_cli_refuses_network_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "overlap.json", {"type": "LionCub", "params": {**MODE, "overlap": True}})
    assert main([str(config), "--workers", "2", "--steps", "1", "--seeds", "0", "--task", TASK]) == 2
    assert "LionCub: " in capsys.readouterr().err


def test_cli_names_a_task_it_cannot_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})
    assert main([str(config), "--task", "no_such_module_here:task", "--steps", "1"]) == 2
    assert "cannot import the task module 'no_such_module_here'" in capsys.readouterr().err
