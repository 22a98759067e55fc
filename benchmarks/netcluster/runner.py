"""Running one command per rank inside a :class:`~benchmarks.netcluster.topology.Cluster`.

Each rank is ``ip netns exec <node namespace> COMMAND`` with the torch.distributed environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and GLOO_SOCKET_IFNAME set to the
node's shaped interface, in its own process group so that it can be stopped as a whole. If one rank
fails, the others are stopped (their collectives would wait for it forever); on timeout or a signal,
all are. The interface counters of every node are read before the first rank starts and after the
last one ended.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from benchmarks import repo_environment
from benchmarks.netcluster.counters import Counters, read_in_netns
from benchmarks.netcluster.signals import shielded
from benchmarks.netcluster.topology import Cluster

TIMEOUT_EXIT_CODE = 124
TAIL_LINES = 40


@dataclass
class RankResult:
    rank: int
    node: int
    exit_code: int | None  # None: never ended by itself (stopped by netcluster)
    elapsed_s: float
    output_tail: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    """What one command did in the cluster. ``wire`` holds each node's counter difference."""

    command: list[str]
    nodes: int
    ranks_per_node: int
    rate_bps: int | None
    delay_s: float
    exit_code: int
    elapsed_s: float
    ranks: list[RankResult]
    wire: list[Counters]
    failed_rank: int | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "rate_bps": self.rate_bps,
            "delay_s": self.delay_s,
            "exit_code": self.exit_code,
            "elapsed_s": self.elapsed_s,
            "failed_rank": self.failed_rank,
            "timed_out": self.timed_out,
            "ranks": [vars(rank) for rank in self.ranks],
            "wire": [counters.to_dict() for counters in self.wire],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        return cls(
            command=list(data["command"]),
            nodes=int(data["nodes"]),
            ranks_per_node=int(data["ranks_per_node"]),
            rate_bps=None if data["rate_bps"] is None else int(data["rate_bps"]),
            delay_s=float(data["delay_s"]),
            exit_code=int(data["exit_code"]),
            elapsed_s=float(data["elapsed_s"]),
            ranks=[RankResult(**rank) for rank in data["ranks"]],
            wire=[Counters.from_dict(node) for node in data["wire"]],
            failed_rank=data.get("failed_rank"),
            timed_out=bool(data.get("timed_out", False)),
        )


def rank_environment(
    cluster: Cluster, rank: int, ranks_per_node: int, master_port: int, base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of ``rank``: ``base`` plus the torch.distributed and netcluster variables, and the
    repository root first on PYTHONPATH (a rank started by path imports this checkout's packages)."""
    world_size = cluster.spec.nodes * ranks_per_node
    node, local_rank = divmod(rank, ranks_per_node)
    link = cluster.spec.link
    env = repo_environment(base)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "LOCAL_SIZE": str(ranks_per_node),
            "NODE_RANK": str(node),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": cluster.node_address(0),
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": cluster.node_ifname,
            "TP_SOCKET_IFNAME": cluster.node_ifname,
            "NCCL_SOCKET_IFNAME": cluster.node_ifname,
            "NETCLUSTER_IFNAME": cluster.node_ifname,
            "NETCLUSTER_NODE": str(node),
            "NETCLUSTER_NODES": str(cluster.spec.nodes),
            "NETCLUSTER_RATE_BPS": "" if link.rate_bps is None else str(link.rate_bps),
            "NETCLUSTER_DELAY_S": repr(link.delay_s),
            "PYTHONUNBUFFERED": "1",
        }
    )
    # Ranks share this machine's cores: one thread each unless the user chose otherwise (as torchrun).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


class _Rank:
    def __init__(
        self,
        rank: int,
        node: int,
        argv: list[str],
        env: dict[str, str],
        echo: TextIO | None,
        lock: threading.Lock,
        log_path: Path | None,
    ) -> None:
        self.rank, self.node = rank, node
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.started = time.monotonic()
        self.ended: float | None = None
        self.stopped = False
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, args=(echo, lock, log_path), daemon=True)
        self.reader.start()

    def _read(self, echo: TextIO | None, lock: threading.Lock, log_path: Path | None) -> None:
        assert self.process.stdout is not None
        log = log_path.open("w") if log_path else None
        try:
            for line in self.process.stdout:
                self.tail.append(line.rstrip("\n"))
                if log:
                    log.write(line)
                if echo is not None:
                    with lock:
                        echo.write(f"[rank {self.rank}] {line}")
                        echo.flush()
        finally:
            if log:
                log.close()

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.stopped = True
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """SIGTERM every running rank's process group, SIGKILL what is left after ``grace_s``."""
    for rank in ranks:
        rank.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank in ranks:
        rank.signal(signal.SIGKILL)
    for rank in ranks:
        rank.process.wait()
        rank.poll()


def run_command(
    cluster: Cluster,
    command: Sequence[str],
    ranks_per_node: int | None = None,
    master_port: int = 29500,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    echo: TextIO | None = sys.stdout,
    echo_ranks: set[int] | None = None,
    log_dir: Path | None = None,
    grace_s: float = 5.0,
) -> RunResult:
    """Run ``command`` once per rank (``nodes * ranks_per_node`` ranks) and wait for all of them.

    ``ranks_per_node`` defaults to the cluster's ``node_size``: the ranks of one node run in its
    namespace and reach each other over its loopback, unshaped.

    Output lines are echoed as ``[rank R] ...`` (only ``echo_ranks``, if given) and the last
    lines of each rank kept for the result; ``log_dir`` also keeps each rank's full output. The
    exit code is 0, the first failing rank's code, or 124 on timeout. An exception (Ctrl-C inside
    :func:`~benchmarks.netcluster.signals.signals_as_exceptions`) stops every rank before it propagates.
    """
    if not command:
        raise ValueError("no command given")
    if ranks_per_node is None:
        ranks_per_node = cluster.spec.node_size
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    base = dict(os.environ if env is None else env)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    world_size = cluster.spec.nodes * ranks_per_node
    before = [read_in_netns(cluster.node_netns(node), cluster.node_ifname) for node in range(cluster.spec.nodes)]
    lock = threading.Lock()
    ranks: list[_Rank] = []
    started = time.monotonic()
    failed_rank: int | None = None
    timed_out = False
    try:
        for rank in range(world_size):
            node = rank // ranks_per_node
            argv = ["ip", "netns", "exec", cluster.node_netns(node), *command]
            rank_env = rank_environment(cluster, rank, ranks_per_node, master_port, base)
            shown = echo if echo_ranks is None or rank in echo_ranks else None
            log_path = log_dir / f"rank{rank}.log" if log_dir is not None else None
            ranks.append(_Rank(rank, node, argv, rank_env, shown, lock, log_path))
        while True:
            codes = [rank.poll() for rank in ranks]
            failed = [rank for rank, code in zip(ranks, codes, strict=True) if code not in (None, 0)]
            if failed:
                failed_rank = min(failed, key=lambda r: (r.ended or 0.0, r.rank)).rank
                break
            if all(code == 0 for code in codes):
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        with shielded("netcluster: stopping the ranks, please wait"):
            _stop(ranks, grace_s)
            for started_rank in ranks:
                started_rank.reader.join(timeout=2.0)
    elapsed = time.monotonic() - started
    after = [read_in_netns(cluster.node_netns(node), cluster.node_ifname) for node in range(cluster.spec.nodes)]
    results = [
        RankResult(
            rank.rank,
            rank.node,
            None if rank.stopped else rank.process.returncode,
            (rank.ended or time.monotonic()) - rank.started,
            list(rank.tail),
        )
        for rank in ranks
    ]
    if timed_out:
        exit_code = TIMEOUT_EXIT_CODE
    elif failed_rank is not None:
        exit_code = ranks[failed_rank].process.returncode
        exit_code = exit_code if exit_code > 0 else 128 - exit_code  # killed by a signal: 128 + signum
    else:
        exit_code = 0
    return RunResult(
        command=list(command),
        nodes=cluster.spec.nodes,
        ranks_per_node=ranks_per_node,
        rate_bps=cluster.spec.link.rate_bps,
        delay_s=cluster.spec.link.delay_s,
        exit_code=exit_code,
        elapsed_s=elapsed,
        ranks=results,
        wire=[a - b for a, b in zip(after, before, strict=True)],
        failed_rank=failed_rank,
        timed_out=timed_out,
    )
