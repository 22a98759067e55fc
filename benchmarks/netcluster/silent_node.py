"""A node that goes silent mid-training: how long the other ranks wait, and with which error.

    python -m benchmarks.netcluster.silent_node --fault freeze --timeout 20
    python -m benchmarks.netcluster.silent_node --fault drop --timeout 20 --json silent.json
    python -m benchmarks.netcluster.silent_node --fault unplug --timeout 20
    python -m benchmarks.netcluster.silent_node --fault freeze --timeout 20 --launch deepspeed [--set-group-timeout]

Builds a cluster of ``--ranks`` nodes (one rank each, ``--bandwidth`` links), runs
:mod:`benchmarks.netcluster.silent_worker` (LionCub 1-bit steps over gloo) on every rank, waits until
each has done a few steps, and makes node ``--node`` go silent (:mod:`benchmarks.netcluster.faults`:
its traffic dropped, its cable pulled, or its processes frozen) while the ranks keep stepping. For every
other rank it prints how long after the fault its step raised, how long after the fault its process was
gone, and the message. A rank still waiting ``--limit`` seconds after the fault is reported as such.
Then every process left in the cluster is killed and the cluster removed. Needs root, like netcluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.netcluster.faults import FAULTS, inject
from benchmarks.netcluster.runner import run_command
from benchmarks.netcluster.signals import Interrupted, signals_as_exceptions
from benchmarks.netcluster.system import NetclusterError, netns_pids
from benchmarks.netcluster.topology import Cluster, ClusterSpec, LinkSpec
from benchmarks.netcluster.units import parse_rate

POLL_S = 0.1


@dataclass
class Outcome:
    """What one rank other than the silent one did after the fault (times from the fault, in seconds)."""

    rank: int
    raised_after_s: float | None  # None: no error before the limit
    exited_after_s: float | None  # None: still running at the limit
    steps: int | None
    error: str | None  # "Type: first line of the message"
    group_timeout_s: float | None  # the timeout of the group its collectives ran on


@dataclass
class Experiment:
    fault: str
    node: int
    ranks: int
    launch: str
    timeout_s: float | None
    limit_s: float
    fault_injected_in_s: float = 0.0
    outcomes: list[Outcome] | None = None
    silent_rank: dict[str, Any] | None = None
    problem: str | None = None


class _Injector:
    """Waits until every rank is stepping, makes the node silent, and watches the other ranks end."""

    def __init__(self, cluster: Cluster, experiment: Experiment, report_dir: Path, startup_s: float) -> None:
        self.cluster, self.experiment, self.report_dir, self.startup_s = cluster, experiment, report_dir, startup_s
        self.fault_at: float | None = None
        self.exited_at: dict[int, float] = {}

    def run(self) -> None:
        experiment = self.experiment
        try:
            ready_by = time.monotonic() + self.startup_s
            while not all((self.report_dir / f"ready-rank{rank}").exists() for rank in range(experiment.ranks)):
                if time.monotonic() > ready_by:
                    experiment.problem = f"the ranks were not all stepping after {self.startup_s:.0f} s"
                    return
                time.sleep(POLL_S)
            started = time.monotonic()
            inject(self.cluster, experiment.node, experiment.fault)
            self.fault_at = time.monotonic()
            experiment.fault_injected_in_s = self.fault_at - started
            others = [rank for rank in range(experiment.ranks) if rank != experiment.node]
            while len(self.exited_at) < len(others) and time.monotonic() - self.fault_at < experiment.limit_s:
                for rank in others:
                    if rank not in self.exited_at and not netns_pids(self.cluster.node_netns(rank)):
                        self.exited_at[rank] = time.monotonic()
                time.sleep(POLL_S)
        except Exception as error:  # noqa: BLE001 - reported with the result, not lost in a thread
            experiment.problem = f"{type(error).__name__}: {error}"
        finally:
            self._kill_everything()

    def _kill_everything(self) -> None:
        """SIGKILL what is left (the silent rank, ranks still waiting): run_command then returns."""
        for node in range(self.experiment.ranks):
            for pid in netns_pids(self.cluster.node_netns(node)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _first_line(report: dict[str, Any]) -> str | None:
    if report.get("raised_at") is None:
        return None
    lines = report["message"].splitlines() or [""]
    return f"{report['error_type']}: {lines[0][:400]}"


def run_experiment(
    fault: str,
    node: int = 1,
    ranks: int = 3,
    timeout_s: float | None = 20.0,
    limit_s: float = 60.0,
    launch: str = "plain",
    set_group_timeout: bool = False,
    rate_bps: int | None = parse_rate("1gbit"),
    startup_s: float = 300.0,
    log_dir: Path | None = None,
) -> Experiment:
    """Make ``node`` of a ``ranks``-node cluster go silent by ``fault`` and measure the others (see module doc)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    if not 0 <= node < ranks or ranks < 2:
        raise ValueError(f"need at least 2 ranks and 0 <= node < ranks, got node {node} of {ranks}")
    experiment = Experiment(fault, node, ranks, launch, timeout_s, limit_s)
    with tempfile.TemporaryDirectory(prefix="silent-node-") as scratch:
        report_dir = Path(scratch)
        command = [sys.executable, "-m", "benchmarks.netcluster.silent_worker", "--report-dir", str(report_dir)]
        command += ["--launch", launch] + (["--timeout", repr(timeout_s)] if timeout_s is not None else [])
        command += ["--set-group-timeout"] if set_group_timeout else []
        with Cluster(ClusterSpec(nodes=ranks, link=LinkSpec(rate_bps=rate_bps))) as cluster:
            injector = _Injector(cluster, experiment, report_dir, startup_s)
            watcher = threading.Thread(target=injector.run, daemon=True)
            watcher.start()
            result = run_command(
                cluster, command, echo=None, timeout_s=startup_s + limit_s + 30, log_dir=log_dir, grace_s=2.0
            )
            watcher.join(timeout=10)
        reports: dict[int, dict[str, Any]] = {}
        for rank in range(ranks):
            for name in (f"report-rank{rank}.json", f"ready-rank{rank}"):  # a rank that never raised: ready only
                path = report_dir / name
                if rank not in reports and path.exists() and path.read_text().strip():
                    reports[rank] = json.loads(path.read_text())
    if injector.fault_at is None:
        tails = {rank.rank: rank.output_tail[-5:] for rank in result.ranks}
        experiment.problem = experiment.problem or f"no fault was injected; the ranks' last lines: {tails}"
        return experiment
    fault_at = injector.fault_at
    experiment.outcomes = []
    for rank in range(ranks):
        report = reports.get(rank, {})
        raised_at = report.get("raised_at")
        outcome = Outcome(
            rank=rank,
            raised_after_s=None if raised_at is None else raised_at - fault_at,
            exited_after_s=injector.exited_at[rank] - fault_at if rank in injector.exited_at else None,
            steps=report.get("steps"),
            error=_first_line(report),
            group_timeout_s=report.get("group_timeout_s"),
        )
        if rank == node:
            experiment.silent_rank = asdict(outcome)
        else:
            experiment.outcomes.append(outcome)
    return experiment


def format_experiment(experiment: Experiment) -> str:
    timeout = "torch's default" if experiment.timeout_s is None else f"{experiment.timeout_s:g} s"
    lines = [
        f"silent node: fault {experiment.fault!r} on node {experiment.node} of {experiment.ranks} "
        f"(one rank each), LionCub 1-bit steps over gloo, {experiment.launch} launch, timeout {timeout}"
    ]
    if experiment.problem is not None:
        return "\n".join([*lines, f"  FAILED: {experiment.problem}"])
    for outcome in experiment.outcomes or []:
        group = "?" if outcome.group_timeout_s is None else f"{outcome.group_timeout_s:g} s"
        if outcome.raised_after_s is None:
            lines.append(
                f"  rank {outcome.rank}: no error {experiment.limit_s:g} s after the fault "
                f"(its group's timeout: {group}); killed"
            )
            continue
        exited = "still running at the limit" if outcome.exited_after_s is None else f"{outcome.exited_after_s:.2f} s"
        lines.append(
            f"  rank {outcome.rank}: raised after {outcome.raised_after_s:.2f} s, process gone after {exited} "
            f"(group timeout {group}): {outcome.error}"
        )
    silent = experiment.silent_rank or {}
    if silent.get("raised_after_s") is not None:
        lines.append(f"  (the silent rank itself raised after {silent['raised_after_s']:.2f} s: {silent['error']})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netcluster.silent_node", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--fault", choices=FAULTS, default="freeze", help="how the node goes silent (default freeze)")
    parser.add_argument("--ranks", type=int, default=3, help="nodes, one rank each (default 3)")
    parser.add_argument("--node", type=int, default=1, help="the node that goes silent (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=20.0, help="process group timeout in s; 0: torch's default (default 20)"
    )
    parser.add_argument("--limit", type=float, default=60.0, help="give up this many s after the fault (default 60)")
    parser.add_argument("--launch", choices=("plain", "deepspeed"), default="plain")
    parser.add_argument(
        "--set-group-timeout", action="store_true", help="deepspeed: set the timeout on the engine's group too"
    )
    parser.add_argument("--bandwidth", type=parse_rate, default=parse_rate("1gbit"))
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every rank's output in DIR/rankR.log")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurement here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with signals_as_exceptions():
            experiment = run_experiment(
                args.fault,
                node=args.node,
                ranks=args.ranks,
                timeout_s=args.timeout or None,
                limit_s=args.limit,
                launch=args.launch,
                set_group_timeout=args.set_group_timeout,
                rate_bps=args.bandwidth,
                log_dir=args.log_dir,
            )
    except NetclusterError as error:
        print(f"netcluster: {error}", file=sys.stderr)
        return 1
    except Interrupted as interrupt:
        print(f"netcluster: {interrupt}; cluster removed", file=sys.stderr)
        return 128 + interrupt.signum
    print(format_experiment(experiment))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(experiment), indent=2) + "\n")
    return 1 if experiment.problem is not None else 0


if __name__ == "__main__":
    sys.exit(main())
