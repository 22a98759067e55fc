"""Packing-kernel benchmarks: throughput next to a plain copy, and optimizer-step memory.

Throughput: for n fp32 elements (1e6..1e8) it times, in the same run and interleaved round by round
with ``torch.clone`` of the same n-element input (the copy every ratio refers to):

- ``pack``    sign -> bits of the n-element update (reads 4n bytes, writes n/8);
- ``vote``    the fused server step over p packed rows of n positions (reads p*n/8, writes n/8);
- ``unpack``  n bits -> n fp32 +1/-1 (reads n/8, writes 4n);
- ``1bit step`` what one rank computes for an n-element bucket of the 1-bit vote: pack n, vote its
  n/p chunk of the p received rows, unpack n (no network in between).

Each is run on the compiled path and on the pure torch path, single-threaded and with all threads.
"GB/s" counts bytes read plus written; "x copy" is that bandwidth over clone's (8n bytes moved);
"time/clone" is the op's time over clone's time. Medians over the rounds.

Outputs of 16 MiB and more: unpack asks for transparent huge pages on them before the first write
(madvise), which removes most of the first-touch page-fault cost that clone (and the torch path) pay
for a fresh output; the rows marked * in the table time the kernels on preallocated outputs instead.

Memory: peak temporary memory of one LionCub step (after a warm-up step has created the momentum),
measured in a fresh subprocess per case as the rise of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) over its RSS before the step, with glibc told to return freed memory at once
(MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_) so that every temporary shows up. Two model sizes,
each 1bit and 4-bit L1: the peak must stay flat as the model grows (bounded by the bucket).

    python -m benchmarks.bench_packing                       # everything, prints tables
    python -m benchmarks.bench_packing --write benchmarks/RESULTS.md
    python -m benchmarks.bench_packing --sizes 1e6 --reps 3 --no-memory    # a quick look

(from the repository root: the measurements then use this checkout's ds_lioncub).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import repo_environment

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before ds_lioncub (and DeepSpeed) is imported
SECTION = "## Packing kernels"


# ====================================================================== throughput


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def paired(op: Callable[[], object], copy: Callable[[], object], reps: int, device: torch.device) -> dict[str, float]:
    """Median times of ``op`` and ``copy``, timed back to back in each round (load drifts cancel)."""
    op()
    copy()
    op_times, copy_times, ratios = [], [], []
    for _ in range(reps):
        t_copy = _time_once(copy, device)
        t_op = _time_once(op, device)
        copy_times.append(t_copy)
        op_times.append(t_op)
        ratios.append(t_op / t_copy)
    return {
        "op_s": statistics.median(op_times),
        "copy_s": statistics.median(copy_times),
        "op_over_copy": statistics.median(ratios),
        "op_best_s": min(op_times),
        "copy_best_s": min(copy_times),
    }


class _Kernels:
    """The compiled op's functions in the generation ``DS_LIONCUB_CUDA_KERNELS`` selects (the packing path's own)."""

    def __init__(self, module: object) -> None:
        from ds_lioncub.comm.packing.torch_impl import TorchPacking
        from ds_lioncub.kernels.compiled import CompiledPacking

        self._ops = CompiledPacking(module, TorchPacking())

    def __getattr__(self, name: str) -> Callable[..., object]:
        function = self._ops.kernel(name)
        if function is None:
            raise AttributeError(name)
        return function


def throughput(sizes: list[int], threads: list[int], paths: list[str], p: int, reps: int, device: str) -> list[dict]:
    from ds_lioncub.comm import packing

    dev = torch.device(device)
    rows_out = []
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        for n in sizes:
            n -= n % (8 * p)
            gen = torch.Generator().manual_seed(n)
            x = torch.randn(n, generator=gen).to(dev)
            rows = torch.randint(0, 256, (p, n // 8), generator=gen, dtype=torch.uint8).to(dev)
            chunk_rows = rows.view(-1)[: n // 8].view(p, n // (8 * p))
            gathered = rows[0].clone()
            cases = {
                "pack": (lambda: packing.pack_signs(x, True), 4 * n + n // 8),
                "vote": (lambda: packing.vote_packed_signs(rows, n, True), p * n // 8 + n // 8),
                "unpack": (lambda: packing.unpack_signs(gathered, n), n // 8 + 4 * n),
                "1bit step": (
                    lambda: (
                        packing.pack_signs(x, True),
                        packing.vote_packed_signs(chunk_rows, n // p, True),
                        packing.unpack_signs(gathered, n),
                    ),
                    (4 * n + n // 8) + (n // 8 + n // (8 * p)) + (n // 8 + 4 * n),
                ),
            }
            # fewer rounds where one round takes seconds (pure torch at 1e8)
            rounds = max(3, min(reps, int(reps * 2e7 / n))) if n > 2e7 else reps
            for path in paths:
                packing.set_packing_path(path)
                choice = packing.packing_path(dev)  # load (or build) before timing
                path_cases = {name: (op, nbytes, lambda: x.clone()) for name, (op, nbytes) in cases.items()}
                if choice.path == "compiled":
                    # the kernels alone: outputs preallocated, next to a copy into a preallocated buffer; the CUDA
                    # op's generation that DS_LIONCUB_CUDA_KERNELS selects (v1: the kernels before v2)
                    module, dst = _Kernels(choice.module), torch.empty_like(x)
                    packed_out = torch.empty(n // 8, dtype=torch.uint8, device=dev)
                    vote_out = torch.empty(n // 8, dtype=torch.uint8, device=dev)
                    chunk_out = torch.empty(n // (8 * p), dtype=torch.uint8, device=dev)
                    signs_out = torch.empty_like(x)
                    copy_into = lambda: dst.copy_(x)  # noqa: E731
                    path_cases.update(
                        {
                            "pack*": (lambda: module.pack_signs(x, True, 1, packed_out), cases["pack"][1], copy_into),
                            "vote*": (
                                lambda: module.vote_packed_signs(rows, n, True, vote_out),
                                cases["vote"][1],
                                copy_into,
                            ),
                            "unpack*": (
                                lambda: module.unpack_signs(gathered, signs_out),
                                cases["unpack"][1],
                                copy_into,
                            ),
                            "1bit step*": (
                                lambda: (
                                    module.pack_signs(x, True, 1, packed_out),
                                    module.vote_packed_signs(chunk_rows, n // p, True, chunk_out),
                                    module.unpack_signs(gathered, signs_out),
                                ),
                                cases["1bit step"][1],
                                copy_into,
                            ),
                        }
                    )
                for op_name, (op, nbytes, copy) in path_cases.items():
                    result = paired(op, copy, rounds, dev)
                    rows_out.append(
                        {
                            "threads": nthreads,
                            "n": n,
                            "path": path,
                            "op": op_name,
                            "bytes": nbytes,
                            "rounds": rounds,
                            **result,
                            "gbps": nbytes / result["op_s"] / 1e9,
                            "copy_gbps": 8 * n / result["copy_s"] / 1e9,
                        }
                    )
                    row = rows_out[-1]
                    print(
                        f"  threads={nthreads} n={n:.0e} {path:8s} {op_name:9s} {row['op_s'] * 1e3:9.2f} ms "
                        f"{row['gbps']:6.2f} GB/s  clone {row['copy_s'] * 1e3:8.2f} ms {row['copy_gbps']:6.2f} GB/s  "
                        f"x copy {row['gbps'] / row['copy_gbps']:.2f}  time/clone {row['op_over_copy']:.2f}",
                        flush=True,
                    )
            packing.set_packing_path(None)
            x = rows = chunk_rows = gathered = None  # free this size's inputs before the next size allocates
    return rows_out


# ====================================================================== memory of one optimizer step


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def memory_worker(layers: int, width: int, bucket: int, path: str, compression: str, check_finite: bool) -> dict:
    """Runs in a fresh process: one warm-up step, then the peak RSS rise of one more step."""
    from ds_lioncub import LionCub
    from ds_lioncub.comm import packing

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    options = (
        {"compression": "1bit"}
        if compression == "1bit"
        else {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "allreduce"}
    )
    optimizer = LionCub(model.parameters(), lr=1e-4, bucket_size=bucket, check_finite=check_finite, **options)
    packing.set_packing_path(path)
    packing.packing_path("cpu")
    optimizer.step()  # creates exp_avg (state, proportional to the model: not a temporary)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status()
    start = time.perf_counter()
    optimizer.step()
    seconds = time.perf_counter() - start
    after = _status()
    return {
        "params": sum(param.numel() for param in model.parameters()),
        "largest": width * width,
        "bucket": bucket,
        "path": path,
        "compression": compression,
        "check_finite": check_finite,
        "step_s": seconds,
        "rss_before": before["VmRSS"],
        "peak_temp": after["VmHWM"] - before["VmRSS"],
        "bucket_bytes_fp32": 4 * bucket,
    }


def memory(models: list[tuple[int, int]], bucket: int, paths: list[str]) -> list[dict]:
    results = []
    env = {
        **repo_environment(),
        "MALLOC_MMAP_THRESHOLD_": "131072",  # big buffers via mmap, unmapped on free: RSS follows live memory
        "MALLOC_TRIM_THRESHOLD_": "131072",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    # check_finite=False leaves out the optimizer's NaN/inf check, whose temporaries follow the largest tensor
    cases = [(c, path, check) for c in ("1bit", "4bit-l1") for path in paths for check in (False, True)]
    for compression, path, check_finite in cases:
        for layers, width in models:
            spec = json.dumps([layers, width, bucket, path, compression, check_finite])
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_packing", "--memory-worker", spec],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"memory worker failed:\n{done.stdout}\n{done.stderr}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            print(
                f"  {compression:8s} {path:8s} check_finite={check_finite!s:5s} params={result['params'] / 1e6:6.1f}M "
                f"largest={result['largest'] / 1e6:5.1f}M bucket={bucket / 1e6:.1f}M "
                f"peak temp {result['peak_temp'] / 2**20:7.1f} MiB  step {result['step_s'] * 1e3:8.1f} ms",
                flush=True,
            )
    return results


# ====================================================================== report


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {python}"


def markdown(args: argparse.Namespace, rows: list[dict], mem: list[dict], notes: dict[str, str]) -> str:
    lines = [SECTION, ""]
    lines.append(f"Command: `{notes['command']}`  ")
    lines.append(f"Date: {notes['date']}; machine: {notes['machine']}; packing op: {notes['op']}  ")
    lines.append(
        f"Load average before / after: {notes['load_before']} / {notes['load_after']} (a shared machine: "
        f"every ratio below compares timings taken back to back in the same round)."
    )
    lines.append("")
    if rows:
        lines.append(
            "Throughput (median of the rounds). GB/s = bytes read + written per second; x copy = that over "
            "`torch.clone` of the same input in the same rounds (8n bytes); time/clone = op time over clone time; "
            "speedup = torch-path time over compiled time. `vote`: p = "
            f"{args.p} rows of n positions; `1bit step`: pack n + vote the n/p chunk + unpack n. Rows marked * "
            "call the kernels with preallocated outputs and compare with `dst.copy_(x)` into a preallocated "
            "buffer: the rows without * (and clone) include first-touch page faults of fresh outputs, which "
            "dominate at n >= 1e7 on this VM."
        )
        lines.append("")
        lines.append(
            "| threads | n | op | compiled ms | GB/s | x copy | time/clone | torch ms | torch x copy | speedup |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        by_key = {(r["threads"], r["n"], r["op"], r["path"]): r for r in rows}
        for (threads, n, op, path), row in by_key.items():
            if path != "compiled":
                continue
            torch_row = by_key.get((threads, n, op, "torch"))
            x_copy = row["gbps"] / row["copy_gbps"]
            torch_cells = ["-", "-", "-"]
            if torch_row:
                torch_cells = [
                    f"{torch_row['op_s'] * 1e3:.2f}",
                    f"{torch_row['gbps'] / torch_row['copy_gbps']:.3f}",
                    f"{torch_row['op_s'] / row['op_s']:.1f}x",
                ]
            lines.append(
                f"| {threads} | {n:.0e} | {op} | {row['op_s'] * 1e3:.2f} | {row['gbps']:.2f} | {x_copy:.2f} | "
                f"{row['op_over_copy']:.2f} | " + " | ".join(torch_cells) + " |"
            )
        lines.append("")
    if mem:
        lines.append(
            "Peak temporary memory of one LionCub step (world of one; fresh process per row; rise of peak RSS over "
            "the RSS before the step, momentum already allocated). Bucket = "
            f"{mem[0]['bucket'] / 2**20:.0f} Mi elements ({mem[0]['bucket_bytes_fp32'] / 2**20:.0f} MiB as fp32)."
        )
        lines.append("")
        lines.append(
            "| compression | path | check_finite | params | largest tensor | peak temporary MiB | / bucket fp32 bytes "
            "| step ms |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for result in mem:
            lines.append(
                f"| {result['compression']} | {result['path']} | {result['check_finite']} | "
                f"{result['params'] / 1e6:.1f}M | {result['largest'] / 1e6:.1f}M | "
                f"{result['peak_temp'] / 2**20:.1f} | {result['peak_temp'] / result['bucket_bytes_fp32']:.2f} | "
                f"{result['step_s'] * 1e3:.1f} |"
            )
        lines.append("")
    if notes.get("summary"):
        lines.append(notes["summary"])
        lines.append("")
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) our section of ``path``; every other section is left as it is."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.write_text(text.rstrip() + "\n")


def summary(rows: list[dict], mem: list[dict]) -> str:
    out = []
    for row in rows:
        if row["path"] != "compiled" or not row["op"].startswith("1bit step"):
            continue
        torch_row = next(
            (
                t
                for t in rows
                if t["op"] == row["op"]
                and t["path"] == "torch"
                and t["n"] == row["n"]
                and t["threads"] == row["threads"]
            ),
            None,
        )
        speedup = f", torch path time / this = {torch_row['op_s'] / row['op_s']:.1f}" if torch_row else ""
        out.append(
            f"threads={row['threads']} n={row['n']:.0e} {row['op']}: {row['gbps'] / row['copy_gbps']:.2f}x copy "
            f"bandwidth (time {row['op_over_copy']:.2f}x the copy){speedup}"
        )
    if out:
        return "Targets (1bit step >= 0.5x copy bandwidth; torch time / compiled time >= 5):\n\n" + "\n".join(
            f"- {line}" for line in out
        )
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="comma-separated element counts")
    parser.add_argument("--threads", default="1,all", help="comma-separated thread counts ('all' = every core)")
    parser.add_argument("--paths", default="compiled,torch")
    parser.add_argument("--p", type=int, default=4, help="voters (rows) in the vote")
    parser.add_argument("--reps", type=int, default=15, help="rounds per measurement (fewer at n > 2e7)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--models",
        default="4x2048,16x2048",
        help="models for the memory part: LAYERSxWIDTH of Linear(WIDTH, WIDTH) layers",
    )
    parser.add_argument(
        "--bucket",
        type=float,
        default=float(1 << 21),
        help="bucket_size for the memory part (2 Mi: every bucket of both default models is full)",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--write", type=Path, help=f"replace the '{SECTION}' section of this markdown file")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.memory_worker:
        print(json.dumps(memory_worker(*json.loads(args.memory_worker))))
        return 0

    from ds_lioncub.comm import packing

    command = "python -m benchmarks.bench_packing " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    notes = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(),
        "load_before": " ".join(f"{v:.1f}" for v in os.getloadavg()),
    }
    choice = packing.packing_path(args.device)
    notes["op"] = f"{choice.path} ({choice.reason})"
    all_threads = os.cpu_count() or 1
    threads = [all_threads if t == "all" else int(t) for t in args.threads.split(",")]
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    paths = args.paths.split(",")
    rows, mem = [], []
    if not args.no_throughput:
        print(f"throughput ({_machine()}):")
        rows = throughput(sizes, threads, paths, args.p, args.reps, args.device)
    if not args.no_memory and args.device == "cpu":
        print("peak temporary memory of one optimizer step:")
        torch.set_num_threads(all_threads)
        models = [tuple(int(v) for v in spec.split("x")) for spec in args.models.split(",")]
        mem = memory(models, int(args.bucket), paths)
    notes["load_after"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    notes["summary"] = summary(rows, mem)
    text = markdown(args, rows, mem, notes)
    print()
    print(text)
    if args.write:
        write_section(args.write, text)
        print(f"wrote section '{SECTION}' of {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
