"""``python -m ds_lioncub.simulate`` end to end on a tiny task: the printed table against separate runs.

The expected gaps are computed here from train_virtual calls made by the test (exact Lion's options
written out by hand) and the arithmetic of the definition (100 x (mode - exact) / exact per seed,
mean, and the half-width of the mean's 95% Student-t interval: over 2 seeds t(1) x sd / sqrt(2) with
t(1) = tan(0.95 pi / 2) = 12.706 in closed form and sd = |g0 - g1| / sqrt(2)), not by the CLI's helpers.
A config the command must refuse is refused before any run trains: the tests count the task's model
builds and look for the per-run lines.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_lioncub.simulate.cli import main
from ds_lioncub.simulate.table import Row, format_table
from ds_lioncub.simulate.tasks import GPTTask
from ds_lioncub.simulate.tasks.gpt import GPTConfig
from ds_lioncub.simulate.train import seed_summary, train_virtual

TASK = "tests.unit.test_simulate_cli:tiny_task"
MODE = {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "compression": "1bit"}


#: A 1-layer, d_model 16 GPT on 100 kB of the pinned corpus, global batch 8 x 16 bytes.
TINY: dict[str, Any] = {
    "name": "tiny",
    "config": GPTConfig(max_seq_len=16, n_layer=1, n_head=2, d_model=16),
    "global_batch_size": 8,
    "seq_len": 16,
    "eval_windows": 16,
    "corpus_bytes": 100_000,
    "eval_batch": 16,
}
BUILDS: list[int] = []  # the seeds counting_task's models were built with
COUNTING = "tests.unit.test_simulate_cli:counting_task"


def tiny_task() -> GPTTask:
    return GPTTask(**TINY)


class CountingTask(GPTTask):
    """The tiny task, recording every model it builds: a refusal before training builds at most one."""

    def build_model(self, seed: int) -> Any:
        BUILDS.append(seed)
        return super().build_model(seed)


def counting_task() -> CountingTask:
    return CountingTask(**TINY)


def write_config(path: Path, optimizer: dict, **extra: Any) -> Path:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer": optimizer, **extra}
    path.write_text(json.dumps(config))
    return path


def table_rows(out: str) -> dict[int, list[str]]:
    """workers -> the cells of its table line (gap mean and half-width split out)."""
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
    out = capsys.readouterr().out
    assert "gap % (mean ± 95% t half-width)" in out
    rows = table_rows(out)
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
        sd = math.sqrt(sum((g - mean) ** 2 for g in gaps))  # ddof 1 with two seeds
        half_width = math.tan(0.95 * math.pi / 2) * sd / math.sqrt(2)
        assert float(cells[0]) == pytest.approx(sum(exact_vals) / 2, abs=5e-5)
        assert float(cells[1]) == pytest.approx(sum(mode_vals) / 2, abs=5e-5)
        assert cells[2] == f"{mean:+.3f}" and float(cells[3]) == pytest.approx(half_width, abs=5e-4 + 1e-9)
        assert cells[4] == ("yes" if abs(mean) > half_width else "no")
        assert float(cells[5]) == pytest.approx(sum(matches) / 2, abs=5e-4)


def test_the_table_gives_the_t_interval_and_calls_real_by_it() -> None:
    # 3 seeds, gaps mean 2.2 and sd 1: beyond 2 sd (2.0), inside t(2) x sd / sqrt(3) = 2.484: not real.
    # t(2) in closed form: P(|T| < t) = t / sqrt(2 + t^2) = 0.95 at 2 degrees of freedom.
    t2 = 0.95 * math.sqrt(2 / (1 - 0.95**2))
    vals = seed_summary([5.0, 5.1, 5.2])
    rows = [
        Row(8, vals, vals, seed_summary([1.2, 2.2, 3.2]), None),
        Row(16, vals, vals, seed_summary([2.0, 3.0, 4.0]), None),  # mean 3 > 2.484: real
        Row(32, vals, vals, seed_summary([4.0]), None),  # one seed: no interval, never real
    ]
    text = format_table(rows)
    assert "gap % (mean ± 95% t half-width)" in text.splitlines()[0]
    cells = table_rows(text)
    assert cells[8][2:5] == ["+2.200", f"{t2 / math.sqrt(3):.3f}", "no"]
    assert cells[16][2:5] == ["+3.000", f"{t2 / math.sqrt(3):.3f}", "yes"]
    assert cells[32][2:5] == ["+4.000", "n/a", "no"]


def test_cli_refuses_another_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "adam.json", {"type": "Adam", "params": {"lr": 1e-3}})
    assert main([str(config), "--workers", "2", "--steps", "1", "--seeds", "0", "--task", TASK]) == 2
    err = capsys.readouterr().err
    assert "LionCub: " in err and "'Adam'" in err and '"type": "LionCub"' in err


@pytest.mark.parametrize(
    ("params", "extra", "expected"),
    [
        # 3 does not divide the global batch of 8: refused before the 2-worker runs train.
        (MODE, {}, "cannot be split into 3 equal micro-batches"),
        # 4-bit L1 fields summed by the all-reduce hold 7 workers: refused at 8 before the 2-worker runs train.
        ({**MODE, "compression": "kbit", "bits": 4, "quantizer": "l1"}, {}, "hold at most 7 workers"),
        ({**MODE, "compression": "auto", "network": {"bandwidth": "1gbit"}}, {}, "ds_lioncub.planner"),
        ({**MODE, "hybrid": {}}, {}, "hybrid applies under ZeRO stage 1, 2 or 3"),
        ({**MODE, "overlap": True}, {"zero_optimization": {"stage": 2}}, "does not support overlap"),
    ],
)
def test_cli_refuses_before_any_run_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], params: dict, extra: dict, expected: str
) -> None:
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": params}, **extra)
    workers = ["2", "3"] if expected.startswith("cannot be split") else ["2", "8"]
    BUILDS.clear()
    argv = [str(config), "--workers", *workers, "--steps", "2", "--seeds", "0", "--task", COUNTING]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: LionCub: ") and expected in err
    assert "val loss" not in out and "[simulate] task" not in out  # no run trained, not even the first count's
    assert len(BUILDS) <= 1  # at most the one model the checks build the optimizers on


def test_options_that_do_not_change_the_math_are_dropped_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dropped = {
        "overlap": True,  # bit-identical to overlap=False by design
        "comm_backend_name": "torch",  # ("mpi" with overlap is a config LionCub refuses; mpi alone is dropped too)
        "consistency_check": {"interval": 10},
        "telemetry": {"vote_stats": True},
    }
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": {**MODE, **dropped}})
    out_json = tmp_path / "rows.json"
    argv = [str(config), "--workers", "2", "--steps", "3", "--seeds", "0", "--task", TASK, "--json-out", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in dropped:
        assert f"[simulate] note: {name} dropped: " in out
    [row] = json.loads(out_json.read_text())
    task = tiny_task()
    assert row["mode_val"] == [train_virtual(task, MODE, 2, 3, 0).val_loss]
    assert row["exact_val"] == [train_virtual(task, {**MODE, "compression": "none"}, 2, 3, 0).val_loss]


@pytest.mark.parametrize("block", [{"hybrid": {"node_size": 2}}, {}], ids=["hybrid-block", "stage-only"])
def test_a_hybrid_config_simulates_its_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str], block: dict) -> None:
    # Compressed LionCub at ZeRO stage 2 runs the hybrid with or without the block. The node is the voter and
    # DeepSpeed clips each node's averaged gradient by its own norm: a binding clip (0.05) tells that rule from
    # the stage-0 fp32 rule (every worker scaled by the mean norm).
    params = {**MODE, **block}
    config = write_config(
        tmp_path / "ds.json",
        {"type": "LionCub", "params": params},
        zero_optimization={"stage": 2},
        gradient_clipping=0.05,
    )
    out_json = tmp_path / "rows.json"
    argv = [str(config), "--workers", "2", "4", "--steps", "4", "--seeds", "0", "--task", TASK]
    assert main([*argv, "--json-out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "each simulated worker is one node" in out and "--workers counts nodes" in out
    assert "[simulate] nodes 4 seed 0 mode: val loss" in out
    rows = json.loads(out_json.read_text())
    task = tiny_task()
    for row in rows:
        nodes = row["workers"]
        # The default: the nodes' mean gradient clipped by its sketched norm, not each node by its own.
        sketched = train_virtual(task, {**MODE, "clip": {"max_norm": 0.05}}, nodes, 4, 0, grad_clip=0.0).val_loss
        per_node = train_virtual(task, MODE, nodes, 4, 0, grad_clip=0.05, clip_rule="per_worker").val_loss
        exact = {"compression": "none", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
        assert row["mode_val"] == [sketched] and sketched != per_node
        assert row["exact_val"] == [train_virtual(task, exact, nodes, 4, 0, grad_clip=0.05).val_loss]


def test_option_clip_trains_against_exact_lion_clipped_at_its_max_norm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mode clips by option clip (the ds_config's gradient_clipping 0); exact Lion beside it clips the mean
    gradient at clip.max_norm, as an exact Lion job with gradient_clipping at that value would (a binding 0.05)."""
    clip = {"max_norm": 0.05, "sketch_bins": 613}
    config = write_config(
        tmp_path / "ds.json", {"type": "LionCub", "params": {**MODE, "clip": clip}}, gradient_clipping=0
    )
    out_json = tmp_path / "rows.json"
    argv = [str(config), "--workers", "2", "--steps", "3", "--seeds", "0", "--task", TASK, "--json-out", str(out_json)]
    assert main(argv) == 0
    [row] = json.loads(out_json.read_text())
    task = tiny_task()
    exact = {"compression": "none", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
    assert row["mode_val"] == [train_virtual(task, {**MODE, "clip": clip}, 2, 3, 0, grad_clip=0.0).val_loss]
    clipped = train_virtual(task, exact, 2, 3, 0, grad_clip=0.05).val_loss
    assert row["exact_val"] == [clipped] and clipped != train_virtual(task, exact, 2, 3, 0, grad_clip=0.0).val_loss


def test_a_missing_matplotlib_is_named_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})
    BUILDS.clear()
    argv = [str(config), "--workers", "2", "--steps", "1", "--seeds", "0", "--task", COUNTING]
    assert main([*argv, "--plot", str(tmp_path / "gap.png")]) == 2
    out, err = capsys.readouterr()
    assert "pip install matplotlib" in err and err.startswith("error: LionCub: ")
    assert BUILDS == [] and "val loss" not in out


def test_cli_names_a_task_it_cannot_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})
    assert main([str(config), "--task", "no_such_module_here:task", "--steps", "1"]) == 2
    assert "cannot import the task module 'no_such_module_here'" in capsys.readouterr().err


def test_help_shows_the_defaults_and_a_run_prints_its_plan_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "virtual worker counts (default: 8 16 32)" in help_text
    assert "optimizer steps per run (default: 300)" in help_text and "(default: 0 1 2)" in help_text
    config = write_config(tmp_path / "ds.json", {"type": "LionCub", "params": MODE})
    argv = [str(config), "--workers", "2", "4", "--steps", "3", "--seeds", "0", "--task", TASK, "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 2 counts x 1 seed x (the mode, exact Lion) = 4 runs of 3 steps, announced before the first one trains.
    plan = next(line for line in out.splitlines() if line.startswith("[simulate] plan: "))
    assert plan.startswith(
        "[simulate] plan: 4 runs (2 worker counts x 1 seed, each the mode and exact Lion), 12 steps;"
    )
    assert " s a step at 4 workers, timed on 2 steps" in plan
    assert out.index("[simulate] plan: ") < out.index("val loss")
