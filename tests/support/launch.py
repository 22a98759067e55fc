"""Starting real multi-process jobs from a test (plain gloo ranks, the deepspeed launcher), with a hard time limit
(a hang fails, never blocks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from examples.compare import free_port, remove_deepspeed_shm_buffers

REPO = Path(__file__).resolve().parents[2]


def worker_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a job's ranks: this checkout first on PYTHONPATH (the ranks import
    ds_lioncub, tests.support and examples from it, whatever is pip-installed), one thread per rank, and
    Python's fault handler on, so that a rank killed by a signal prints every thread's Python stack."""
    path = os.pathsep.join(part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}


def failed_ranks_report(script: str, world_size: int, codes: list[int | None], outputs: list[str]) -> str:
    """The exit codes of all ranks, then every failing rank's whole output (the rank that failed first is
    often not the one whose error the others report). A code of None: the rank was killed at the time limit."""
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    sections = [f"{script}: rank(s) {', '.join(map(str, failed))} of {world_size} failed (exit codes {codes})"]
    for rank in failed:
        sections.append(f"----- rank {rank} exited with {codes[rank]}; its whole output -----\n{outputs[rank]}")
    return "\n".join(sections)


def run_ranks(script: Path, world_size: int, work_dir: Path, timeout_s: float = 240.0) -> list[dict[str, object]]:
    """Run ``script RANK WORLD STORE OUT`` as ``world_size`` processes; return each rank's saved results.

    Each rank writes its output to ``work_dir/rank<r>.log`` (a file, not a pipe: a pipe that nobody reads
    while the parent waits on another rank would block a rank that prints much). A failing rank fails the
    call with every failing rank's whole output; a job past ``timeout_s`` is killed and reported with all.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    store = work_dir / "store"
    env = worker_environment()
    logs = [work_dir / f"rank{rank}.log" for rank in range(world_size)]
    procs = []
    for rank in range(world_size):
        with open(logs[rank], "w") as log:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(rank), str(world_size), str(store), str(work_dir)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        codes = [proc.poll() for proc in procs]  # a rank that ended first (with its error) keeps its code
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        outputs = [log.read_text(errors="replace") for log in logs]
        raise AssertionError(
            f"{script.name} with {world_size} ranks did not finish in {timeout_s} s (hang?)\n"
            + failed_ranks_report(script.name, world_size, codes, outputs)
        ) from None
    codes = [proc.returncode for proc in procs]
    if any(code != 0 for code in codes):
        outputs = [log.read_text(errors="replace") for log in logs]
        raise AssertionError(failed_ranks_report(script.name, world_size, codes, outputs))
    return [torch.load(work_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def run_deepspeed(
    script: Path,
    num_ranks: int,
    script_args: list[str],
    result_files: list[Path],
    timeout_s: float = 900.0,
    environment: dict[str, str] | None = None,
) -> str:
    """Start ``script`` with the real ``deepspeed`` launcher on ``num_ranks`` local ranks; return its output.

    The launcher sometimes aborts with code 250 at exit after the work is done ("terminate called
    without an active exception"); that counts as success only when every rank wrote its results.
    """
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(num_ranks),
        "--master_port",
        str(port := free_port()),
        str(script),
        *script_args,
    ]
    env = worker_environment(**(environment or {}))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"deepspeed launch of {script.name} did not finish in {timeout_s} s (hang?)") from error
    finally:
        remove_deepspeed_shm_buffers(port)
    output = done.stdout + done.stderr
    missing = [path for path in result_files if not path.exists()]
    if done.returncode not in (0, 250) or missing:
        raise AssertionError(f"deepspeed launch exited with {done.returncode}, missing {missing}:\n{output[-6000:]}")
    return output


def run_main_and_resume(
    script: Path, num_ranks: int, out: Path, main_timeout_s: float, resume_timeout_s: float
) -> dict[str, Any]:
    """``script --phase main`` then ``--phase resume`` (a new job, from main's checkpoint) under the deepspeed
    launcher; each rank's results of both, and the checkpoint directory (``out/ckpt``)."""
    results: dict[str, Any] = {"checkpoint": out / "ckpt"}
    for phase, timeout_s in (("main", main_timeout_s), ("resume", resume_timeout_s)):
        files = [out / f"{phase}-rank{rank}.pt" for rank in range(num_ranks)]
        run_deepspeed(script, num_ranks, ["--out", str(out), "--phase", phase], files, timeout_s=timeout_s)
        results[phase] = [torch.load(path, weights_only=False) for path in files]
    return results


def ok_records(records: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """The per-rank records of a scenario that ran; fails with the first rank's error (and traceback) otherwise."""
    for rank, record in enumerate(records):
        if record.get("error") is not None:
            raise AssertionError(
                f"{what} raised on rank {rank}: {record['error']}\n{record.get('traceback', '')[-3000:]}"
            )
    return records


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """As the ranks run (one torch thread each), so that a gradient recomputed here sums in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
