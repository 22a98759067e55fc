"""Command line: ``python -m benchmarks.netcluster [options] -- COMMAND ...``.

Examples::

    python -m benchmarks.netcluster --ranks 4 --bandwidth 1gbit -- python -m benchmarks.bench_comm
    python -m benchmarks.netcluster --ranks 2 --bandwidth 100mbit --latency 0.2ms --json run.json -- python train.py
    python -m benchmarks.netcluster --cleanup          # remove clusters left by killed runs
    python -m benchmarks.netcluster --check            # can this machine run it?
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.netcluster.report import format_summary
from benchmarks.netcluster.runner import run_command
from benchmarks.netcluster.signals import Interrupted, signals_as_exceptions
from benchmarks.netcluster.system import NetclusterError, unavailable_reason
from benchmarks.netcluster.topology import Cluster, ClusterSpec, LinkSpec, cleanup_leftovers, find_leftovers
from benchmarks.netcluster.units import parse_duration, parse_rate


def _rate(text: str) -> int | None:
    return None if text.lower() in ("none", "unlimited", "0") else parse_rate(text)


def _bytes(text: str) -> int:
    lowered = text.lower().removesuffix("b")
    for suffix, scale in (("k", 1024), ("m", 1024**2)):
        if lowered.endswith(suffix):
            return int(float(lowered[:-1]) * scale)
    return int(lowered)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netcluster",
        description="Run a command on N ranks of this machine, each node in its own network namespace "
        "behind a rate-limited (and optionally delayed) link, and report the bytes on the wire. "
        "Needs root.",
        epilog="Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, "
        "MASTER_PORT, GLOO_SOCKET_IFNAME and NETCLUSTER_{IFNAME,NODE,NODES,RATE_BPS,DELAY_S}.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--cleanup",
        action="store_true",
        help="remove clusters whose netcluster process is gone (add --all for every cluster)",
    )
    mode.add_argument("--check", action="store_true", help="say whether this machine can run netcluster")
    mode.add_argument("--list", action="store_true", help="list existing netcluster clusters")
    parser.add_argument("--all", action="store_true", help="with --cleanup: also remove clusters of live runs")
    parser.add_argument("--ranks", type=int, default=2, help="world size (default 2)")
    parser.add_argument(
        "--node-size",
        "--ranks-per-node",
        dest="ranks_per_node",
        type=int,
        default=1,
        help="ranks per node: they share one namespace and link, and reach each other over its loopback, "
        "unshaped (default 1: every rank is a node)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_rate,
        default=parse_rate("1gbit"),
        help="per-link rate, each direction, tc syntax: 1gbit, 100mbit, 125mbps (bytes/s); "
        "'none' for unshaped links (default 1gbit)",
    )
    parser.add_argument(
        "--latency",
        type=parse_duration,
        default=0.0,
        help="one-way delay added on each node's uplink, e.g. 0.2ms (needs netem; default 0)",
    )
    parser.add_argument("--mtu", type=int, default=1500, help="link MTU (default 1500)")
    parser.add_argument(
        "--burst", type=_bytes, default=None, help="tbf bucket, e.g. 256k (default max(128k, 2 ms at the rate))"
    )
    parser.add_argument(
        "--no-offload",
        action="store_true",
        help="MTU-sized frames only (no GSO super-frames): the counters see every frame's headers; costs CPU",
    )
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--timeout", type=float, default=None, help="stop every rank after this many seconds")
    parser.add_argument(
        "--echo",
        choices=("all", "rank0", "none"),
        default="all",
        help="whose output to print, prefixed with [rank R] (default all)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="also write each rank's output to DIR/rankR.log")
    parser.add_argument("--json", type=Path, default=None, help="write the run's result (counters, exit codes) here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with signals_as_exceptions():
            if args.check:
                reason = unavailable_reason()
                print(f"netcluster: cannot run here: {reason}" if reason else "netcluster: ok")
                return 1 if reason else 0
            if args.list:
                for leftover in find_leftovers():
                    print(
                        f"{leftover.cluster_id}: owner pid {leftover.owner_pid} "
                        f"{'alive' if leftover.owner_alive else 'gone'}, "
                        f"{'processes inside' if leftover.busy else 'idle'}: {' '.join(leftover.namespaces)}"
                    )
                return 0
            if args.cleanup:
                removed = cleanup_leftovers(include_live=args.all)
                for leftover in removed:
                    print(f"removed cluster {leftover.cluster_id}: {' '.join(leftover.namespaces)}")
                print(f"netcluster: removed {len(removed)} cluster(s)")
                return 0
            if not command:
                parser.error("no command given (put it after --)")
            if args.ranks < 1 or args.ranks_per_node < 1 or args.ranks % args.ranks_per_node:
                parser.error("--ranks must be a positive multiple of --node-size")
            link = LinkSpec(
                rate_bps=args.bandwidth,
                delay_s=args.latency,
                mtu=args.mtu,
                burst_bytes=args.burst,
                segment_offload=not args.no_offload,
            )
            spec = ClusterSpec(nodes=args.ranks // args.ranks_per_node, link=link, node_size=args.ranks_per_node)
            echo_ranks = {0} if args.echo == "rank0" else None
            with Cluster(spec) as cluster:
                result = run_command(
                    cluster,
                    command,
                    master_port=args.master_port,
                    timeout_s=args.timeout,
                    echo=None if args.echo == "none" else sys.stdout,
                    echo_ranks=echo_ranks,
                    log_dir=args.log_dir,
                )
            print(format_summary(result), file=sys.stderr)
            if args.json is not None:
                args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
            return result.exit_code
    except NetclusterError as error:
        print(f"netcluster: {error}", file=sys.stderr)
        return 1
    except Interrupted as interrupt:
        print(f"netcluster: {interrupt}; cluster removed", file=sys.stderr)
        return 128 + interrupt.signum
    except KeyboardInterrupt:
        print("netcluster: interrupted; cluster removed", file=sys.stderr)
        return 130
