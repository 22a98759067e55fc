"""Compressed collectives against fp32 / bf16 all-reduce on an emulated cluster.

For each world size p and tensor size n it times, on every rank of a netcluster:

| op | what |
|---|---|
| fp32 | ``dist.all_reduce`` of n fp32 values (the gradient all-reduce of exact Lion) |
| bf16 | ``dist.all_reduce`` of n bf16 values |
| 1bit | ``CompressedBackend.vote_1bit``, in place: all-to-all of packed signs + all-gather of the packed vote |
| sign4-ar, sign4-a2a | ``vote_kbit`` 4-bit sign fields, one uint8 all-reduce / all-to-all + 1-bit all-gather |
| l1-8-ar, l1-4-a2a | ``vote_kbit`` L1-quantized 8-bit (all-reduce) and 4-bit (all-to-all) fields |

(any ``kbit:<sign|l1>:<2|4|8>:<allreduce|alltoall>`` works in ``--ops`` too; a compressed op with
``@COUNT`` runs its vote in pipeline chunks of COUNT elements, ``@whole`` as one piece, instead of
``CompressedBackend``'s default ``pipeline_chunk_numel``). Next to each time: the
bytes each rank put on its link (from the interface counters, re-cut into MTU-sized frames: see
:func:`benchmarks.netcluster.counters.as_mtu_frames`), the bytes the algorithm must send (its model,
no headers), the ideal time (the busiest link direction's bytes / link rate) and the efficiency
(ideal / measured). It also checks the 1-bit vote's wire bytes against 2(p-1)/p * n/8 plus headers.

Run everything from the repository root (needs root; builds one emulated cluster per world size)::

    python -m benchmarks.bench_comm --world-sizes 2,4 --bandwidth 1gbit --max-n 1e8 --markdown out.md

or one world size under an existing harness invocation::

    python -m benchmarks.netcluster --ranks 4 --bandwidth 1gbit -- python -m benchmarks.bench_comm --max-n 1e7

The wire columns assume one rank per node (the driver's set-up): ranks that share a node
(``--ranks-per-node`` > 1) share its counters, and their "per rank" bytes are the node's. Outside a
netcluster (no ``NETCLUSTER_IFNAME``) the times are measured and the wire columns left empty.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import REPO
from benchmarks.collective_clock import CollectiveClock
from benchmarks.netcluster.counters import TCP_FRAME_HEADERS, Counters, as_mtu_frames, read_sysfs
from benchmarks.netcluster.units import format_rate, parse_count, parse_rate

DEFAULT_OPS = (
    "fp32",
    "bf16",
    "1bit",
    "kbit:sign:4:allreduce",
    "kbit:sign:4:alltoall",
    "kbit:l1:8:allreduce",
    "kbit:l1:4:alltoall",
)
SHORT_NAMES = {
    "sign4-ar": "kbit:sign:4:allreduce",
    "sign4-a2a": "kbit:sign:4:alltoall",
    "l1-8-ar": "kbit:l1:8:allreduce",
    "l1-4-a2a": "kbit:l1:4:alltoall",
}


# ---------------------------------------------------------------------------------------------- ops


@dataclass(frozen=True)
class OpSpec:
    """One benchmarked operation, parsed from ``fp32``, ``bf16``, ``1bit`` or ``kbit:<q>:<b>:<algo>``,
    a compressed one optionally with ``@COUNT`` or ``@whole`` (its pipeline chunks)."""

    kind: str  # "fp32" | "bf16" | "1bit" | "kbit"
    quantizer: str = ""
    bits: int = 0
    algorithm: str = ""
    chunk: str = ""  # "" (the backend's default), "whole", or an element count as given

    @classmethod
    def parse(cls, text: str) -> OpSpec:
        text, _, chunk = text.partition("@")
        text = SHORT_NAMES.get(text, text)
        if chunk:
            if text in ("fp32", "bf16"):
                raise ValueError(f"op {text}@{chunk}: only the compressed ops run in pipeline chunks")
            if chunk != "whole":
                parse_count(chunk)
        if text in ("fp32", "bf16", "1bit"):
            return cls(text, chunk=chunk)
        parts = text.split(":")
        if (
            len(parts) != 4
            or parts[0] != "kbit"
            or parts[1] not in ("sign", "l1")
            or parts[2] not in ("2", "4", "8")
            or parts[3] not in ("allreduce", "alltoall")
        ):
            raise ValueError(
                f"unknown op {text!r}: use fp32, bf16, 1bit or kbit:<sign|l1>:<2|4|8>:<allreduce|alltoall>"
            )
        return cls("kbit", parts[1], int(parts[2]), parts[3], chunk)

    @property
    def name(self) -> str:
        """The op as ``--ops`` spells it (short names expanded)."""
        base = self.kind if self.kind != "kbit" else f"kbit:{self.quantizer}:{self.bits}:{self.algorithm}"
        return f"{base}@{self.chunk}" if self.chunk else base

    @property
    def pipeline_chunk_numel(self) -> int | None:
        """``CompressedBackend``'s ``pipeline_chunk_numel`` for this op."""
        from ds_lioncub.comm.schedule import DEFAULT_PIPELINE_CHUNK_NUMEL

        if not self.chunk:
            return DEFAULT_PIPELINE_CHUNK_NUMEL
        return None if self.chunk == "whole" else parse_count(self.chunk)

    @property
    def label(self) -> str:
        if self.kind == "fp32":
            return "fp32 all-reduce"
        if self.kind == "bf16":
            return "bf16 all-reduce"
        base = "1-bit vote" if self.kind == "1bit" else f"{self.bits}-bit {self.quantizer} vote, {self.algorithm}"
        if self.chunk == "whole":
            return f"{base} (one piece)"
        return f"{base} (chunks of {self.chunk})" if self.chunk else base

    def payload_bytes(self, n: int, p: int) -> float:
        """Bytes one rank must send (bandwidth-optimal algorithms, no headers): ds_lioncub.comm.wire's model."""
        from ds_lioncub.comm import wire
        from ds_lioncub.comm.kbit import KbitCodec

        if self.kind in ("fp32", "bf16"):
            return float(wire.dense_all_reduce_bytes(n, p, 4 if self.kind == "fp32" else 2))
        if self.kind == "1bit":
            return float(wire.vote_1bit_bytes(n, p))
        codec = KbitCodec.build(p, self.bits, self.quantizer, self.algorithm)  # type: ignore[arg-type]
        return float(wire.kbit_bytes(n, codec, "vote"))  # make_op runs vote_kbit with its default aggregation

    def supported(self, p: int) -> str | None:
        """Why this op cannot run at world size ``p`` (``None``: it can)."""
        from ds_lioncub.comm.kbit import max_allreduce_world_size

        if self.kind != "kbit" or self.algorithm == "alltoall":
            return None
        largest = max_allreduce_world_size(self.bits, self.quantizer)  # type: ignore[arg-type]
        return None if p <= largest else f"{self.bits}-bit {self.quantizer} all-reduce holds at most {largest} ranks"


def make_op(
    spec: OpSpec, n: int, rank: int, clock: CollectiveClock, segment_bytes: int | None = None
) -> Callable[[int], object]:
    """A closure running the op once (inputs built here, outside the timing); ``clock`` times its collectives.

    ``segment_bytes``: the compressed ops' ``TorchTransport.segment_bytes`` (``None``: the library's
    default; 0: never segment).
    """
    import torch
    import torch.distributed as dist

    from ds_lioncub.comm import CompressedBackend
    from ds_lioncub.comm.transport import COMMUNICATING_METHODS, TorchTransport

    generator = torch.Generator().manual_seed(1000 + rank)
    update = torch.randn(n, generator=generator)
    if spec.kind in ("fp32", "bf16"):
        buffer = update if spec.kind == "fp32" else update.to(torch.bfloat16)
        del update
        # Values grow by p per call; harmless for timing over a handful of repetitions.
        all_reduce = clock.time(lambda: dist.all_reduce(buffer, op=dist.ReduceOp.SUM))
        return lambda step: all_reduce()
    backend = CompressedBackend(pipeline_chunk_numel=spec.pipeline_chunk_numel)
    transport = backend.transport
    if segment_bytes is not None and isinstance(transport, TorchTransport):
        transport.segment_bytes = segment_bytes or None
    # Instrument this benchmark's own backend instance (the library is not changed).
    for name in COMMUNICATING_METHODS:
        setattr(transport, name, clock.time(getattr(transport, name)))
    if spec.kind == "1bit":
        # In place, as the all-reduces above run: the vote overwrites the update with ±1 (the signs
        # it packs next time are then the same on every rank, which costs the packing the same).
        return lambda step: backend.vote_1bit(update, step, out=update)
    return lambda step: backend.vote_kbit(
        update,
        step,
        bits=spec.bits,
        quantizer=spec.quantizer,  # type: ignore[arg-type]
        algorithm=spec.algorithm,
    )  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- worker


@dataclass
class Measurement:
    """One op at one size: medians over repetitions, traffic per rank per call."""

    op: str
    label: str
    n: int
    p: int
    reps: int
    time_s: float  # median over repetitions of the slowest rank's time
    times_s: list[float]
    collective_s: float  # median over repetitions of the mean over ranks of the time inside collectives
    tx_counted: float  # mean over ranks of counted tx bytes
    tx_frames: float  # mean over ranks, as MTU-sized frames
    busiest_frames: float  # max over ranks and directions, as MTU-sized frames
    payload: float  # algorithm's bytes per rank
    ideal_s: float | None  # busiest_frames / link rate


def _wire_delta(ifname: str | None, before: Counters | None) -> Counters:
    if ifname is None or before is None:
        return Counters()
    return read_sysfs(ifname) - before


def measure(
    spec: OpSpec,
    n: int,
    reps: int,
    warmup: int,
    ifname: str | None,
    rate_bps: int | None,
    mtu: int,
    barrier_traffic: Counters,
    segment_bytes: int | None = None,
) -> Measurement:
    import torch
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    clock = CollectiveClock()
    run_once = make_op(spec, n, rank, clock, segment_bytes)
    times, collective, tx_counted, tx_frames, busiest = [], [], [], [], []
    for step in range(1, warmup + reps + 1):
        dist.barrier()
        before = read_sysfs(ifname) if ifname else None
        clock.seconds = 0.0
        start = time.perf_counter()
        result = run_once(step)
        elapsed = time.perf_counter() - start
        in_collectives = clock.seconds
        del result
        dist.barrier()
        counted = _wire_delta(ifname, before) - barrier_traffic
        row = torch.tensor(
            [elapsed, in_collectives, counted.tx_bytes, counted.rx_bytes, counted.tx_packets, counted.rx_packets],
            dtype=torch.float64,
        )
        rows = [torch.empty_like(row) for _ in range(p)]
        dist.all_gather(rows, row)
        if step <= warmup:
            continue
        per_rank = [Counters(*(max(0, int(v)) for v in r[2:].tolist())) for r in rows]
        frames = [as_mtu_frames(c, mtu) for c in per_rank]
        times.append(max(float(r[0]) for r in rows))
        collective.append(statistics.fmean(float(r[1]) for r in rows))
        tx_counted.append(statistics.fmean(c.tx_bytes for c in per_rank))
        tx_frames.append(statistics.fmean(f.tx_bytes for f in frames))
        busiest.append(max(max(f.tx_bytes, f.rx_bytes) for f in frames))
    del run_once
    busiest_frames = statistics.median(busiest)
    return Measurement(
        op=spec.name,
        label=spec.label,
        n=n,
        p=p,
        reps=reps,
        time_s=statistics.median(times),
        times_s=times,
        collective_s=statistics.median(collective),
        tx_counted=statistics.median(tx_counted),
        tx_frames=statistics.median(tx_frames),
        busiest_frames=busiest_frames,
        payload=spec.payload_bytes(n, p),
        ideal_s=None if rate_bps is None or ifname is None else busiest_frames * 8 / rate_bps,
    )


def barrier_traffic(ifname: str | None, samples: int = 5) -> Counters:
    """This rank's traffic for one barrier (the one that follows each timed call), median of samples."""
    import torch.distributed as dist

    if ifname is None:
        return Counters()
    deltas = []
    for _ in range(samples):
        dist.barrier()
        before = read_sysfs(ifname)
        dist.barrier()
        deltas.append(read_sysfs(ifname) - before)
    return Counters(
        *(
            int(statistics.median(getattr(d, f) for d in deltas))
            for f in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        )
    )


def sizes_up_to(max_n: int, min_n: int = 10**6) -> list[int]:
    """1e6, 1e7, 1e8, ... up to ``max_n`` (``max_n`` itself last if it is not a power of ten)."""
    sizes, n = [], min_n
    while n <= max_n:
        sizes.append(n)
        n *= 10
    if not sizes or sizes[-1] != max_n:
        sizes.append(max_n)
    return sizes


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    ifname = os.environ.get("NETCLUSTER_IFNAME") or None
    rate = os.environ.get("NETCLUSTER_RATE_BPS") or None
    rate_bps = int(rate) if rate else None
    specs = [OpSpec.parse(op) for op in args.ops.split(",")]
    sizes = args.sizes or sizes_up_to(args.max_n, min(args.min_n, args.max_n))
    packing = packing_description()
    if rank == 0:
        print(f"packing: {packing}", flush=True)
    calibration = barrier_traffic(ifname)
    results: list[Measurement] = []
    skipped: list[str] = []
    for n in sizes:
        reps = args.reps if args.reps else (3 if n <= 10**7 else 2)
        for spec in specs:
            reason = spec.supported(p)
            if reason:
                if n == sizes[0]:
                    skipped.append(f"{spec.label}: {reason}")
                continue
            result = measure(
                spec, n, reps, args.warmup, ifname, rate_bps, args.mtu, calibration, args.gloo_segment_bytes
            )
            results.append(result)
            if rank == 0:
                print(
                    f"p={p} n={n:.0e} {spec.label}: {result.time_s:.4f} s, {result.tx_frames / 1e6:.3f} MB sent/rank",
                    flush=True,
                )
    if rank == 0:
        report = {
            "p": p,
            "rate_bps": rate_bps,
            "mtu": args.mtu,
            "ifname": ifname,
            "threads": torch.get_num_threads(),
            "packing": packing,
            "barrier_traffic": calibration.to_dict(),
            "skipped": skipped,
            "results": [asdict(result) for result in results],
        }
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(format_tables([report]))
    dist.barrier()
    # gloo sometimes aborts in its destructors at interpreter exit ("terminate called without an
    # active exception", exit code 134) after all the work is done; leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- report


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f}" if nbytes < 1e7 else f"{nbytes / 1e6:.1f}"


def _seconds(value: float) -> str:
    return f"{value:.4f}" if value < 1 else f"{value:.2f}"


def header_overhead(payload: float, mtu: int) -> float:
    """Headers a payload needs in MTU-sized TCP frames (66 bytes per ``mtu - 52`` payload bytes)."""
    return math.ceil(payload / (mtu - (TCP_FRAME_HEADERS - 14))) * TCP_FRAME_HEADERS


def format_tables(reports: Sequence[dict[str, Any]]) -> str:
    """Markdown: one table per world size, plus the issue-6 target check at the largest n."""
    out: list[str] = []
    for report in reports:
        p, rate_bps, mtu = report["p"], report["rate_bps"], report["mtu"]
        link = "unshaped links" if rate_bps is None else f"{format_rate(rate_bps)} links"
        out.append(f"### p = {p}, {link}, MTU {mtu}\n")
        if "packing" in report:
            out.append(f"Packing: {report['packing']}; {report.get('threads', '?')} thread(s) per rank.\n")
        out.append(
            "| n | op | time (s) | in collectives (s) | speed-up vs fp32 | sent/rank (MB) | model (MB) | "
            "wire/model | ideal (s) | efficiency |"
        )
        out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        results = report["results"]
        fp32 = {r["n"]: r["time_s"] for r in results if r["op"] == "fp32"}
        for r in results:
            speedup = f"{fp32[r['n']] / r['time_s']:.1f}x" if r["n"] in fp32 else "-"
            measured = report.get("ifname", "ncl0") is not None  # outside netcluster: no counters
            ratio = f"{r['tx_frames'] / r['payload']:.3f}" if r["payload"] and measured else "-"
            sent = _mb(r["tx_frames"]) if measured else "-"
            ideal = "-" if r["ideal_s"] is None else _seconds(r["ideal_s"])
            efficiency = "-" if r["ideal_s"] is None else f"{100 * r['ideal_s'] / r['time_s']:.0f}%"
            out.append(
                f"| {r['n']:.0e} | {r['label']} | {_seconds(r['time_s'])} | {_seconds(r['collective_s'])} | "
                f"{speedup} | "
                f"{sent} | {_mb(r['payload'])} | {ratio} | {ideal} | {efficiency} |"
            )
        for line in report.get("skipped", []):
            out.append(f"\nskipped: {line}")
        out.append("")
        out.extend(target_lines(report))
        out.append("")
    return "\n".join(out)


def target_lines(report: dict[str, Any]) -> list[str]:
    """The headline checks at the largest n: 1-bit speed-up over fp32, and its wire bytes vs the model."""
    results = report["results"]
    if not results:
        return []
    n = max(r["n"] for r in results)
    at_n = {r["op"]: r for r in results if r["n"] == n}
    lines = []
    measured = report.get("ifname", "ncl0") is not None
    if "1bit" in at_n and "fp32" in at_n:
        one, fp = at_n["1bit"], at_n["fp32"]
        wire = (
            f"; bytes on the busiest link: {fp['busiest_frames'] / max(one['busiest_frames'], 1):.1f}x fewer"
            if measured
            else ""
        )
        lines.append(
            f"- n = {n:.0e}: 1-bit vote {fp['time_s'] / one['time_s']:.1f}x faster than fp32 all-reduce "
            f"({_seconds(one['time_s'])} s vs {_seconds(fp['time_s'])} s; target >= 20x). Time inside "
            f"collectives: {_seconds(one['collective_s'])} s vs {_seconds(fp['collective_s'])} s = "
            f"{fp['collective_s'] / one['collective_s']:.1f}x{wire}."
        )
    if "1bit" in at_n and measured:
        one = at_n["1bit"]
        formula = one["payload"]  # ds_lioncub.comm.wire's bytes for the 1-bit vote
        expected = formula + header_overhead(formula, report["mtu"])
        lines.append(
            f"- n = {n:.0e}: 1-bit vote sent {one['tx_frames']:.0f} B/rank as {report['mtu']}-byte frames "
            f"(counters: {one['tx_counted']:.0f} B); 2(p-1)/p*n_pad/8 = {formula:.0f} B, plus TCP/IP/Ethernet "
            f"headers {expected:.0f} B: {100 * (one['tx_frames'] / expected - 1):+.2f}% "
            f"(target within 5%)."
        )
    return lines


# ---------------------------------------------------------------------------------------------- driver


def machine_notes() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        cpu = model
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), {_memory_gib()} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, ds_lioncub at {_revision()}, "
        f"load average before the run {os.getloadavg()[0]:.1f}"
    )


def _revision() -> str:
    import subprocess

    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "ds_lioncub"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"{head}{' + uncommitted changes in ds_lioncub/' if dirty else ''}"


def _memory_gib() -> str:
    try:
        kib = int(
            next(
                line.split()[1]
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            )
        )
        return f"{kib / 2**20:.0f}"
    except (OSError, StopIteration, ValueError):
        return "?"


def packing_description() -> str:
    """Which packing path ds_lioncub takes on CPU tensors here, and why."""
    from ds_lioncub.comm import packing

    packing_path = getattr(packing, "packing_path", None)
    if packing_path is None:
        return "pure torch (no compiled path in this version)"
    choice = packing_path("cpu")
    return f"{choice.path} ({choice.reason})"


def driver(args: argparse.Namespace) -> int:
    from benchmarks.netcluster import Cluster, ClusterSpec, Interrupted, LinkSpec, run_command, signals_as_exceptions
    from benchmarks.netcluster.system import NetclusterError

    rate_bps = None if args.bandwidth.lower() in ("none", "unlimited") else parse_rate(args.bandwidth)
    forwarded = [
        f"--ops={args.ops}",
        f"--max-n={args.max_n}",
        f"--min-n={args.min_n}",
        f"--warmup={args.warmup}",
        f"--reps={args.reps}",
        f"--mtu={args.mtu}",
    ]
    if args.gloo_segment_bytes is not None:
        forwarded.append(f"--gloo-segment-bytes={args.gloo_segment_bytes}")
    if args.sizes:
        forwarded.append("--sizes=" + ",".join(str(n) for n in args.sizes))
    reports = []
    notes = machine_notes()
    started = time.time()
    try:
        with signals_as_exceptions(), tempfile.TemporaryDirectory(prefix="bench_comm_") as tmp:
            for p in args.world_sizes:
                out = Path(tmp) / f"p{p}.json"
                spec = ClusterSpec(nodes=p, link=LinkSpec(rate_bps=rate_bps, mtu=args.mtu))
                with Cluster(spec) as cluster:
                    result = run_command(
                        cluster,
                        [sys.executable, str(Path(__file__).resolve()), *forwarded, f"--out={out}"],
                        echo=sys.stderr,
                        echo_ranks={0},
                        timeout_s=args.timeout,
                    )
                if not result.ok:
                    failed = result.ranks[result.failed_rank] if result.failed_rank is not None else None
                    tail = "\n".join(failed.output_tail) if failed else ""
                    print(f"bench_comm: p={p} failed with exit code {result.exit_code}\n{tail}", file=sys.stderr)
                    return result.exit_code or 1
                reports.append(json.loads(out.read_text()))
    except NetclusterError as error:
        print(f"bench_comm: {error}", file=sys.stderr)
        return 1
    except Interrupted as interrupt:
        print(f"bench_comm: {interrupt}; the cluster was removed", file=sys.stderr)
        return 128 + interrupt.signum
    command = " ".join(["python", "benchmarks/bench_comm.py", *sys.argv[1:]])
    text = (
        f"Command: `{command}`  \nMachine: {notes}  \n"
        f"Total benchmark time: {time.time() - started:.0f} s\n\n" + format_tables(reports)
    )
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--world-sizes",
        default="2,4",
        type=lambda s: [int(v) for v in s.split(",")],
        help="driver: world sizes, one cluster each (default 2,4)",
    )
    parser.add_argument("--bandwidth", default="1gbit", help="driver: link rate, tc syntax or 'none' (default 1gbit)")
    parser.add_argument("--timeout", type=float, default=None, help="driver: seconds per world size")
    parser.add_argument("--markdown", default=None, help="driver: also write the tables here")
    parser.add_argument("--json", default=None, help="driver: also write the raw results here")
    parser.add_argument(
        "--ops", default=",".join(DEFAULT_OPS), help=f"comma-separated (default {','.join(DEFAULT_OPS)})"
    )
    parser.add_argument("--max-n", type=parse_count, default=10**8, help="largest n (default 1e8)")
    parser.add_argument("--min-n", type=parse_count, default=10**6, help="smallest n (default 1e6)")
    parser.add_argument(
        "--sizes",
        type=lambda s: [parse_count(v) for v in s.split(",")] if s else None,
        default=None,
        help="explicit comma-separated sizes (overrides --min-n/--max-n)",
    )
    parser.add_argument("--reps", type=int, default=0, help="timed repetitions (default 3, 2 above n = 1e7)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--mtu", type=int, default=1500, help="link MTU (the driver sets it; workers use it for frames)"
    )
    parser.add_argument(
        "--gloo-segment-bytes",
        type=int,
        default=None,
        help="the compressed ops' TorchTransport.segment_bytes: gloo collectives above it go out in segments "
        "(default: the library's, 1 MiB; 0: never segment)",
    )
    parser.add_argument("--out", default=None, help="worker: rank 0 writes its JSON report here")
    args = parser.parse_args(argv)
    for op in args.ops.split(","):
        OpSpec.parse(op)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if "RANK" in os.environ else driver(args)


if __name__ == "__main__":
    sys.exit(main())
