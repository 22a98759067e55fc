"""Lion Cub against Lion end to end: the example GPT on an emulated cluster.

Trains the example GPT (examples/gpt.py) on N ranks, each in its own network namespace behind a
rate-limited link (benchmarks/netcluster), once per method of benchmarks/train_methods.py: Lion with
an fp32 or bf16 gradient all-reduce, Lion Cub 1-bit / 4-bit sign / 8-bit L1 (all under the real
DeepSpeed engine), the 1-bit runs at beta2 = 0.95 with and without head momentum sync, and what a
torch user would pick instead: DDP + plain Lion with DDP's bf16_compress_hook or PowerSGD hook.

Every method starts from the same weights and sees the same batches. Out come a per-step breakdown
(forward, backward, update, communication, total; see benchmarks/train_worker.py for what each
includes), the final validation loss of each method against its reference, and two plots: train
loss vs step and vs training time::

    sudo python -m benchmarks.bench_train --ranks 4 --bandwidth 1gbit --steps 200 --out-dir runs/train_1gbit
    python -m benchmarks.bench_train --report-only --out-dir runs/train_1gbit     # tables and plots again
    python -m benchmarks.bench_train --loopback --ranks 2 --steps 20 --out-dir runs/try  # no root: local, unshaped
    sudo python -m benchmarks.bench_train --ranks 4 --node-size 2 --bandwidth 1gbit --out-dir runs/zero \
        --methods lioncub_1bit,lion_zero2,lioncub_1bit_zero2_hybrid     # 2 nodes x 2 ranks, ZeRO inside a node

(from the repository root). Methods run one after another, each as a fresh set of processes in the same
cluster, started by path (benchmarks/train_worker.py) with this checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from benchmarks import REPO, repo_environment
from benchmarks.netcluster.signals import Interrupted, signals_as_exceptions
from benchmarks.netcluster.system import NetclusterError, unavailable_reason
from benchmarks.netcluster.units import format_rate, parse_rate
from benchmarks.train_methods import Method, TrainSettings, select_methods
from benchmarks.train_report import load_results, markdown_report, write_plots

WORKER = REPO / "benchmarks" / "train_worker.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True, help="per-method JSON, logs, report.md and plots go here")
    p.add_argument("--methods", default="all", help="comma-separated method names (benchmarks/train_methods.py) or all")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument(
        "--node-size",
        type=int,
        default=1,
        help="ranks per node: they share one namespace and link and talk to each other unshaped; only traffic "
        "between nodes crosses the shaped links (default 1: every rank is a node)",
    )
    p.add_argument("--bandwidth", type=parse_rate, default=parse_rate("1gbit"), help="per-link rate (tc syntax)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows of seq-len tokens")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per method before its ranks are stopped")
    p.add_argument(
        "--loopback",
        action="store_true",
        help="run the ranks as local processes on loopback (no root, no shaping, no wire counters)",
    )
    p.add_argument("--report-only", action="store_true", help="only rebuild report.md and the plots from --out-dir")
    defaults = TrainSettings()
    g = p.add_argument_group("model and training (common to every method)")
    for item in fields(TrainSettings):
        flag = "--" + item.name.replace("_", "-")
        g.add_argument(
            flag,
            type=type(getattr(defaults, item.name)),
            default=getattr(defaults, item.name),
            help=f"default {getattr(defaults, item.name)}",
        )
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1:
        p.error("--ranks and --steps must be >= 1")
    if args.node_size < 1 or args.ranks % args.node_size:
        p.error("--ranks must be a positive multiple of --node-size")
    try:
        args.settings = TrainSettings(**{item.name: getattr(args, item.name) for item in fields(TrainSettings)})
        args.method_list = select_methods(args.methods)
    except ValueError as error:
        p.error(str(error))
    return args


def worker_command(args: argparse.Namespace, method: Method) -> list[str]:
    return [
        sys.executable,
        str(WORKER),
        "--methods",
        method.name,
        "--steps",
        str(args.steps),
        "--eval-windows",
        str(args.eval_windows),
        "--out-dir",
        str(args.out_dir.resolve()),
        "--corpus-cache",
        str((args.out_dir / "corpus_cache").resolve()),
        "--settings",
        json.dumps(asdict(args.settings)),
        "--node-size",
        str(args.node_size),
    ]


def run_loopback(command: list[str], ranks: int, log_dir: Path, timeout_s: float, port: int, node_size: int = 1) -> int:
    """Ranks as plain local processes (no namespaces): for trying the benchmark without root.

    ``node_size`` only numbers the ranks as nodes (LOCAL_RANK, LOCAL_WORLD_SIZE); nothing is shaped.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    procs = []
    for rank in range(ranks):
        env = {
            **repo_environment(),
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank % node_size),
            "LOCAL_WORLD_SIZE": str(node_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
        }
        log = (log_dir / f"rank{rank}.log").open("w")
        procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    try:
        while any(proc.poll() is None for proc, _ in procs):
            if time.monotonic() > deadline or any(proc.poll() not in (None, 0) for proc, _ in procs):
                break
            time.sleep(0.1)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    return next((code for code in codes if code != 0), 0)


def machine_notes(result: dict[str, Any]) -> str:
    """This machine and the run's ranks and links (read from a result, so --report-only says the same)."""
    import torch

    rate = result.get("link_rate_bps")
    link = f"{format_rate(rate)} links (netcluster)" if rate else "loopback, unshaped"
    node_size = int(result.get("node_size", 1))
    ranks = f"{result['world_size']} ranks"
    if node_size > 1:
        ranks += f" as {result['world_size'] // node_size} nodes x {node_size} (a node's ranks share its loopback)"
    return (
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}; {ranks}, {link}."
    )


def run_all(args: argparse.Namespace) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from examples.compare import free_port, remove_deepspeed_shm_buffers
    from examples.corpus import DEFAULT_MAX_BYTES, build_corpus

    build_corpus(None, DEFAULT_MAX_BYTES, cache_dir=args.out_dir / "corpus_cache")  # once, before any rank
    for stale in args.method_list:
        (args.out_dir / f"{stale.name}.json").unlink(missing_ok=True)
    if args.loopback:
        for method in args.method_list:
            print(f"[bench_train] {method.name} on {args.ranks} local ranks", flush=True)
            port = free_port()
            code = run_loopback(
                worker_command(args, method),
                args.ranks,
                args.out_dir / "logs" / method.name,
                args.timeout,
                port=port,
                node_size=args.node_size,
            )
            remove_deepspeed_shm_buffers(port)
            if code != 0:
                print(
                    f"[bench_train] {method.name} failed with exit code {code}; see "
                    f"{args.out_dir / 'logs' / method.name}",
                    file=sys.stderr,
                )
                return code
        return 0

    from benchmarks.netcluster import Cluster, ClusterSpec, LinkSpec, run_command

    reason = unavailable_reason()
    if reason:
        print(
            f"bench_train: cannot build the emulated cluster: {reason}. Run as root, or pass --loopback "
            f"for unshaped local ranks.",
            file=sys.stderr,
        )
        return 1
    spec = ClusterSpec(
        nodes=args.ranks // args.node_size, link=LinkSpec(rate_bps=args.bandwidth), node_size=args.node_size
    )
    with signals_as_exceptions(), Cluster(spec) as cluster:
        for index, method in enumerate(args.method_list):
            print(
                f"[bench_train] {method.name} on {spec.nodes} node(s) x {spec.node_size} rank(s), "
                f"{format_rate(args.bandwidth)} links between nodes",
                flush=True,
            )
            result = run_command(
                cluster,
                worker_command(args, method),
                master_port=29500 + index,
                timeout_s=args.timeout,
                echo_ranks={0},
                log_dir=args.out_dir / "logs" / method.name,
            )
            remove_deepspeed_shm_buffers(29500 + index)
            (args.out_dir / "logs" / method.name / "netcluster.json").write_text(
                json.dumps(result.to_dict(), indent=2) + "\n"
            )
            if not result.ok:
                print(
                    f"[bench_train] {method.name} failed (exit code {result.exit_code}, rank "
                    f"{result.failed_rank}); see {args.out_dir / 'logs' / method.name}",
                    file=sys.stderr,
                )
                return result.exit_code
    return 0


def report(args: argparse.Namespace) -> None:
    names = [method.name for method in args.method_list] if args.methods != "all" else None
    results = load_results(args.out_dir, names)
    if not results:
        raise SystemExit(f"bench_train: no results in {args.out_dir}")
    text = markdown_report(results) + "\n" + machine_notes(next(iter(results.values()))) + "\n"
    (args.out_dir / "report.md").write_text(text)
    plots = write_plots(results, args.out_dir)
    print(text)
    print("plots: " + ", ".join(str(path) for path in plots))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.report_only:
        try:
            code = run_all(args)
        except NetclusterError as error:
            print(f"bench_train: {error}", file=sys.stderr)
            return 1
        except Interrupted as interrupt:  # SIGINT/SIGTERM/SIGHUP: same exit codes as netcluster's own CLI
            print(f"bench_train: {interrupt}; the cluster was removed", file=sys.stderr)
            return 128 + interrupt.signum
        except KeyboardInterrupt:
            print("bench_train: interrupted; the cluster was removed", file=sys.stderr)
            return 130
        if code != 0:
            return code
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
