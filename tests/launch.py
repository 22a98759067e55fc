"""Starting real multi-process gloo jobs from a test, with a hard time limit (a hang fails, never blocks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run_ranks(script: Path, world_size: int, work_dir: Path, timeout_s: float = 240.0) -> list[dict[str, object]]:
    """Run ``script RANK WORLD STORE OUT`` as ``world_size`` processes; return each rank's saved results."""
    work_dir.mkdir(parents=True, exist_ok=True)
    store = work_dir / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), str(store), str(work_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"{script.name} with {world_size} ranks did not finish in {timeout_s} s (hang?)")
    failed = [(rank, proc.returncode, outputs[rank]) for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        rank, code, out = failed[0]
        raise AssertionError(f"rank {rank} of {world_size} exited with {code}:\n{out[-4000:]}")
    return [torch.load(work_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
