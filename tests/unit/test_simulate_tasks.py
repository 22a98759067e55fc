"""The default task of ``python -m ds_lioncub.simulate`` ships with the package and works where it is installed.

The repository's examples/ re-export the package's modules: the same objects, so the training scripts,
benchmarks and tests train the same model on the same bytes. An installed copy (the package alone, in a
folder with no examples/ on the path) runs the command's default task, and its losses equal the checkout's
examples task's, trained here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ds_lioncub
import examples.corpus
import examples.gpt
import examples.simulate_gpt
from ds_lioncub.simulate import tasks
from ds_lioncub.simulate.cli import DEFAULT_TASK
from ds_lioncub.simulate.tasks import corpus, gpt, gpt_task
from ds_lioncub.simulate.train import train_virtual

REPO = Path(__file__).resolve().parents[2]


def test_examples_re_export_the_packages_modules() -> None:
    assert examples.gpt.GPT is gpt.GPT and examples.gpt.GPTConfig is gpt.GPTConfig
    assert examples.corpus.load_corpus is corpus.load_corpus and examples.corpus.build_corpus is corpus.build_corpus
    assert examples.corpus.DEFAULT_MAX_BYTES == corpus.DEFAULT_MAX_BYTES
    assert examples.simulate_gpt.small_gpt is gpt_task.small_gpt is tasks.small_gpt
    assert examples.simulate_gpt.task_by_name is gpt_task.task_by_name
    assert DEFAULT_TASK == "ds_lioncub.simulate.tasks:small_gpt"


@pytest.mark.slow  # a fresh interpreter imports DeepSpeed and trains two 1-step runs of the 467k GPT: 15-40 s here
def test_an_installed_copy_runs_the_default_task_without_examples(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(Path(ds_lioncub.__file__).parent, site / "ds_lioncub", ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out_json = tmp_path / "rows.json"
    script = (
        "import importlib.util, sys\n"
        "import ds_lioncub\n"
        f"assert ds_lioncub.__file__.startswith({str(site)!r}), ds_lioncub.__file__\n"
        "assert importlib.util.find_spec('examples') is None, 'examples/ is importable'\n"
        "from ds_lioncub.simulate.cli import main\n"
        f"sys.exit(main([{str(REPO / 'configs' / 'lioncub_1bit.json')!r}, '--workers', '2', '--steps', '1',"
        f" '--seeds', '0', '--threads', '1', '--no-progress', '--json-out', {str(out_json)!r}]))\n"
    )
    # The torch packing path (the same bits as the compiled one) spares the copy a JIT build of the op.
    env = {**os.environ, "PYTHONPATH": str(site), "DS_LIONCUB_PACKING": "torch", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "task gpt-small" in done.stdout
    [row] = json.loads(out_json.read_text())
    mode = {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, "compression": "1bit"}  # the config's
    exact = {**mode, "compression": "none"}
    task = examples.simulate_gpt.small_gpt()
    # Another thread count may change a matmul's last bits; another task, corpus or init moves the loss by far more.
    assert row["exact_val"][0] == pytest.approx(train_virtual(task, exact, 2, 1, 0).val_loss, rel=1e-6)
    assert row["mode_val"][0] == pytest.approx(train_virtual(task, mode, 2, 1, 0).val_loss, rel=1e-6)
