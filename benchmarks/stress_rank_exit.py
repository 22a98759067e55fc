"""Stress check: does a rank of a gloo job ever die at exit (SIGABRT, -6) instead of ending with its code?

Runs the 3-rank set-up scenario job (tests/workers/set_up_scenarios.py: 12 scenarios, 9 of which raise on
every rank, then a barrier and exit) ``--jobs`` times, ``--concurrent`` at once, optionally beside
``--hogs`` busy-looping processes and a loop of real JIT builds of the packing op into the same cache
(``--rebuild``: the op with one extra macro, a new build key each time). Prints every rank's exit codes,
the whole output of any rank that did not exit 0, and the load average; exits 1 if any rank failed.

    python -m benchmarks.stress_rank_exit --jobs 50
    python -m benchmarks.stress_rank_exit --jobs 50 --hogs 2 --rebuild

Not a CI test: how often the race this guards against shows depends on the machine's load
(benchmarks/RESULTS.md, "Ranks that abort at exit"). A run writes nothing outside a temporary directory
(the rebuild loop's builds are removed after it).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.launch import REPO, worker_environment

WORKER = REPO / "tests" / "workers" / "set_up_scenarios.py"
RANKS = 3

HOG = "while True: pass"


def start_job(work: Path) -> list[subprocess.Popen[bytes]]:
    work.mkdir(parents=True)
    env = worker_environment()
    procs = []
    for rank in range(RANKS):
        with open(work / f"rank{rank}.log", "wb") as log:
            command = [sys.executable, str(WORKER), str(rank), str(RANKS), str(work / "store"), str(work)]
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work))
    return procs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="jobs in all (default 50)")
    parser.add_argument("--concurrent", type=int, default=1, help="jobs at once (default 1)")
    parser.add_argument("--hogs", type=int, default=0, help="busy-looping processes beside the jobs")
    parser.add_argument("--rebuild", action="store_true", help="real op builds into the same JIT cache, in a loop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take (default 600)")
    args = parser.parse_args(argv)

    load = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    builds = 0
    rebuild: subprocess.Popen[bytes] | None = None
    codes: collections.Counter[int | None] = collections.Counter()
    failed: list[tuple[Path, list[int | None]]] = []
    root = Path(tempfile.mkdtemp(prefix="stress-rank-exit-"))
    started = time.monotonic()
    try:
        done = 0
        while done < args.jobs:
            if args.rebuild and (rebuild is None or rebuild.poll() is not None):
                builds += rebuild is not None and rebuild.returncode == 0
                variant = ["-m", "tests.support.jit_variant", str(time.time_ns()), "--remove"]  # a new key each time
                rebuild = subprocess.Popen(
                    [sys.executable, *variant], env=worker_environment(), cwd=REPO, stdout=subprocess.DEVNULL
                )
            batch = min(args.concurrent, args.jobs - done)
            jobs = [(root / f"job{done + j}", start_job(root / f"job{done + j}")) for j in range(batch)]
            for work, procs in jobs:
                deadline = time.monotonic() + args.timeout
                for proc in procs:
                    try:
                        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                job_codes: list[int | None] = [proc.returncode for proc in procs]
                codes.update(job_codes)
                if any(code != 0 for code in job_codes):
                    failed.append((work, job_codes))
                else:
                    shutil.rmtree(work)
            done += batch
            print(f"{done}/{args.jobs} jobs, rank exit codes so far {dict(codes)}", flush=True)
    finally:
        for proc in load:
            proc.kill()
        if rebuild is not None:
            rebuild.wait()
            builds += rebuild.returncode == 0
    minutes = (time.monotonic() - started) / 60
    print(
        f"\n{args.jobs} jobs of {RANKS} ranks ({args.concurrent} at once, {args.hogs} hogs, "
        f"{builds} op builds beside them) in {minutes:.1f} min; load average {os.getloadavg()[0]:.1f}; "
        f"rank exit codes {dict(codes)}; failed jobs {len(failed)}"
    )
    for work, job_codes in failed:
        print(f"\n== {work}: exit codes {job_codes}")
        for rank, code in enumerate(job_codes):
            if code != 0:
                print(f"-- rank {rank} ({code}):\n{(work / f'rank{rank}.log').read_text(errors='replace')}")
    if not failed:
        shutil.rmtree(root)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
