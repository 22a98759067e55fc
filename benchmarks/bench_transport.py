"""MPI transport against torch transport: the same CompressedBackend operations, timed over each.

Run under mpirun; every rank initialises torch.distributed (gloo, from the MPI rank and size) and
times, for each transport, the same operations on the same inputs:

| op | what |
|---|---|
| 1bit | ``CompressedBackend.vote_1bit``: all-to-all of packed signs + all-gather of the packed vote |
| 4bit | ``vote_kbit(bits=4)``, sign fields: one uint8 SUM all-reduce of n/2 bytes |
| fp32 | ``transport.all_reduce_sum`` of n fp32 values (the gradient all-reduce of exact Lion) |

For each it reports the median over ``--reps`` of the slowest rank's time, the part of it spent
inside the transport's collectives (the rest is packing / counting), the bytes each rank sent
(CommStats, identical for both transports by construction) and the effective bus bandwidth
(bytes sent / time inside the transport). Results are checked to be identical across transports.

    mpirun -np 2 python -m benchmarks.bench_transport --numel 1e7 --reps 10

(from the repository root; ``pip install -e ".[mpi]"`` puts mpirun in the virtual environment.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: it picks its accelerator then

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ds_lioncub.comm import CompressedBackend  # noqa: E402
from ds_lioncub.comm.transport import COMMUNICATING_METHODS  # noqa: E402

OPS = ("1bit", "4bit", "fp32")
TRANSPORTS = ("torch", "mpi")


class TimedTransport:
    """Wraps a transport's collectives and adds up the seconds spent inside them."""

    def __init__(self, transport: Any) -> None:
        self.inner = transport
        self.seconds = 0.0
        for name in COMMUNICATING_METHODS:
            setattr(self, name, self._timed(getattr(transport, name)))

    def _timed(self, collective: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(tensor: Any) -> Any:
            start = time.perf_counter()
            result = collective(tensor)
            self.seconds += time.perf_counter() - start
            return result

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def init_torch(comm: Any) -> None:
    port = None
    if comm.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def operation(backend: CompressedBackend, op: str, update: torch.Tensor) -> Callable[[int], torch.Tensor]:
    if op == "1bit":
        return lambda step: backend.vote_1bit(update, step)
    if op == "4bit":
        return lambda step: backend.vote_kbit(update, step, bits=4)
    buffer = torch.empty_like(update)

    def fp32(step: int) -> torch.Tensor:
        buffer.copy_(update)
        return backend.transport.all_reduce_sum(buffer)

    return fp32


def bench(comm: Any, numel: int, reps: int, warmup: int) -> list[dict[str, Any]]:
    update = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + comm.rank))
    rows = []
    outputs: dict[tuple[str, str], torch.Tensor] = {}
    for op in OPS:
        for name in TRANSPORTS:
            backend = CompressedBackend(comm_backend_name=name)
            timed = TimedTransport(backend.transport)
            backend.transport = timed
            run = operation(backend, op, update)
            for step in range(1, warmup + 1):
                run(step)
            totals, inside = [], []
            stats_before = timed.inner.stats.bytes_sent
            for step in range(1, reps + 1):
                comm.Barrier()
                timed.seconds = 0.0
                start = time.perf_counter()
                out = run(step)
                elapsed = time.perf_counter() - start
                # the slowest rank decides a collective's time
                totals.append(comm.allreduce(elapsed, op=MPI.MAX))
                inside.append(comm.allreduce(timed.seconds, op=MPI.MAX))
            outputs[(op, name)] = out.clone()
            sent = (timed.inner.stats.bytes_sent - stats_before) // reps
            rows.append(
                {
                    "op": op,
                    "transport": name,
                    "numel": numel,
                    "world_size": comm.size,
                    "median_ms": 1e3 * statistics.median(totals),
                    "min_ms": 1e3 * min(totals),
                    "comm_ms": 1e3 * statistics.median(inside),
                    "bytes_sent_per_rank": sent,
                }
            )
        reference, got = outputs[(op, "torch")], outputs[(op, "mpi")]
        same = torch.equal(reference, got)
        differ = (reference != got).float().mean().item()
        relative = ((reference - got).abs() / reference.abs().clamp_min(1e-30)).max().item()
        for row in rows[-len(TRANSPORTS) :]:
            row["identical_to_torch"] = same
            row["elements_differing"] = differ
            row["max_relative_difference"] = relative
    return rows


def _same(row: dict[str, Any]) -> str:
    if row["identical_to_torch"]:
        return "identical"
    if row["transport"] == "torch":
        return "(reference)"
    # float sums with p > 2: gloo adds around its ring, the MPI transport in rank order
    return f"{100 * row['elements_differing']:.0f}% differ, max rel {row['max_relative_difference']:.0e}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| op | transport | median ms | min ms | in collectives ms | MB sent / rank | GB/s in collectives "
        "| result vs torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rate = row["bytes_sent_per_rank"] / (row["comm_ms"] / 1e3) / 1e9 if row["comm_ms"] > 0 else float("nan")
        lines.append(
            f"| {row['op']} | {row['transport']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['comm_ms']:.1f} "
            f"| {row['bytes_sent_per_rank'] / 1e6:.2f} | {rate:.2f} | {_same(row)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=1e7)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", type=Path, help="also write the rows here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    init_torch(comm)
    rows = bench(comm, int(args.numel), args.reps, args.warmup)
    if comm.rank == 0:
        print(
            f"# {comm.size} ranks, n = {int(args.numel):,}, {args.reps} reps, {args.threads} torch thread(s)/rank, "
            f"torch {torch.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}, "
            f"{platform.machine()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"
        )
        print(markdown(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
