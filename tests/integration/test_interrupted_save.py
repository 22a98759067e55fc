"""A checkpoint save interrupted by a dying rank leaves the previous checkpoint loadable.

LionCub writes its side files (atomically) before DeepSpeed's save, which writes ``latest`` last: a
rank dying during the save of tag "broken" must leave ``latest`` at tag "good", and a new job must
resume from "good" with every rank's own momentum.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.compare import free_port, remove_deepspeed_shm_buffers
from tests.support.launch import REPO, run_deepspeed, worker_environment

pytestmark = pytest.mark.deepspeed

WORKER = REPO / "tests" / "workers" / "interrupted_save.py"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> Path:
    out = tmp_path_factory.mktemp("interrupted")
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(port := free_port()),
        str(WORKER),
        "--out",
        str(out),
        "--phase",
        "crash",
    ]
    try:
        done = subprocess.run(command, env=worker_environment(), capture_output=True, text=True, timeout=600, cwd=REPO)
    finally:
        remove_deepspeed_shm_buffers(port)
    assert done.returncode != 0, "the job whose rank died reported success"
    assert (out / "good-momenta-rank1.pt").exists(), (done.stdout + done.stderr)[-4000:]
    return out


def test_latest_still_names_the_last_complete_checkpoint(interrupted: Path) -> None:
    checkpoint = interrupted / "ckpt"
    assert (checkpoint / "latest").read_text().strip() == "good"
    assert sorted(p.name for p in (checkpoint / "good").glob("lioncub_*")) == [
        "lioncub_dp_rank_00000.pt",
        "lioncub_dp_rank_00001.pt",
    ]
    broken = sorted(p.name for p in (checkpoint / "broken").glob("lioncub_dp_rank_*.pt"))
    assert "lioncub_dp_rank_00001.pt" not in broken  # the rank died before writing it


def test_a_new_job_resumes_from_the_complete_checkpoint_with_each_ranks_momentum(interrupted: Path) -> None:
    files = [interrupted / f"resume-rank{rank}.pt" for rank in range(2)]
    run_deepspeed(WORKER, 2, ["--out", str(interrupted), "--phase", "resume"], files)
    for rank, path in enumerate(files):
        results = torch.load(path, weights_only=False)
        assert Path(results["loaded"]).parent.name == "good"  # DeepSpeed returns a file inside the tag
        assert results["lioncub_step"] == 2
        saved = torch.load(interrupted / f"good-momenta-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(results["momenta"], saved, strict=True)), f"rank {rank}"
