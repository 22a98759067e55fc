"""Lion (fp32 gradient averaging) vs Lion Cub 1-bit vs Lion Cub 4-bit sign, same seed and steps.

    python examples/compare.py                 # defaults: 2 CPU ranks, ~30 s per run on 2 cores
    python examples/compare.py --steps 600 --d-model 256 --out-dir runs/

Each method runs train_gpt.py under torchrun (python -m torch.distributed.run --standalone) as a
fresh job, so no state leaks between them. The corpus is built once and shared so all three train
on identical bytes. Bytes are the optimizer's own comm_stats() counters, per rank per step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpus import DEFAULT_MAX_BYTES, build_corpus

TRAIN_SCRIPT = Path(__file__).resolve().with_name("train_gpt.py")


@dataclass(frozen=True)
class Method:
    label: str
    key: str  # file-name friendly
    args: tuple[str, ...]


METHODS: tuple[Method, ...] = (
    Method("Lion fp32 allreduce", "lion_fp32", ("--compression", "none", "--comm-dtype", "fp32")),
    Method("Lion Cub 1-bit", "lioncub_1bit", ("--compression", "1bit")),
    Method("Lion Cub 4-bit sign", "lioncub_4bit_sign", ("--compression", "kbit", "--bits", "4", "--quantizer", "sign")),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--corpus", type=Path, default=None, help="training text file (default: Python stdlib sources)")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--out-dir", type=Path, default=None, help="keep per-run JSON summaries here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    return p.parse_args()


def run_method(method: Method, common: list[str], args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    json_out = out_dir / f"{method.key}.json"
    json_out.unlink(missing_ok=True)  # a stale summary must never pass for this run's result
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
        str(TRAIN_SCRIPT), *method.args, *common, "--json-out", str(json_out),
    ]
    print(f"\n=== {method.label} ===\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if not json_out.exists():
        raise SystemExit(f"{method.label}: run failed (exit code {proc.returncode}), no summary at {json_out}")
    if proc.returncode != 0:
        # Process-group teardown can abort after the work is done; the summary is written before it.
        print(f"warning: {method.label} exited with code {proc.returncode} after writing its summary", flush=True)
    summary: dict[str, Any] = json.loads(json_out.read_text())
    summary["job_wall_s"] = wall
    return summary


def print_table(results: list[tuple[Method, dict[str, Any]]]) -> None:
    baseline = results[0][1]["bytes_sent_per_step"]
    header = (f"{'method':<22} {'train loss':>10} {'val loss':>9} {'step ms':>8} {'opt ms':>7} "
              f"{'bytes/step/rank':>16} {'bits/param':>10} {'vs fp32':>8} {'in sync':>7}")
    print(header)
    print("-" * len(header))
    for method, r in results:
        ratio = r["bytes_sent_per_step"] / baseline if baseline > 0 else float("nan")
        print(f"{method.label:<22} {r['final_train_loss']:>10.4f} {r['val_loss']:>9.4f} "
              f"{1e3 * r['mean_step_time_s']:>8.1f} {1e3 * r['mean_optimizer_step_time_s']:>7.1f} "
              f"{r['bytes_sent_per_step']:>16,.0f} {r['bits_sent_per_param_per_step']:>10.3f} "
              f"{ratio:>8.4f} {'yes' if r['params_in_sync'] else 'NO':>7}")


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lioncub_compare_") as tmp:
        out_dir = args.out_dir if args.out_dir is not None else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        # Build the corpus once: every rank of every run then reads the same file.
        corpus_path = Path(tmp) / "corpus.bin"
        data, source = build_corpus(args.corpus, args.corpus_bytes)
        corpus_path.write_bytes(data.numpy().tobytes())
        print(f"corpus: {source}", flush=True)

        common = [
            "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--lr", str(args.lr), "--seed", str(args.seed), "--n-layer", str(args.n_layer),
            "--n-head", str(args.n_head), "--d-model", str(args.d_model),
            "--corpus", str(corpus_path), "--corpus-bytes", "0",
        ]
        results = [(m, run_method(m, common, args, out_dir)) for m in METHODS]

    first = results[0][1]
    print(f"\n{args.nproc} ranks x {first['threads_per_rank']} thread(s), {args.steps} steps, "
          f"batch {args.batch_size}x{args.seq_len} per rank, {first['n_params']:,} params, seed {args.seed}")
    print("train loss: mean of the last 10 steps over ranks; step/opt ms: mean after 3 warmup steps;")
    print("bytes: comm_stats().bytes_sent per step per rank; vs fp32: bytes / Lion fp32 bytes\n")
    print_table(results)
    # Not a bug when the two Lion Cub rows match: both compute sign(sum of the ranks' signs) with
    # the same tie rule, only encoded differently (packed bits + all-to-all vs 4-bit field sums).
    print("note: 1-bit and 4-bit sign votes are the same majority vote in different encodings, so "
          "their losses match exactly;\n      they differ only in bytes and time")
    walls = ", ".join(f"{m.key} {r['job_wall_s']:.1f}s" for m, r in results)
    print(f"\njob wall times: {walls}; total {time.perf_counter() - t_start:.1f}s")
    if args.out_dir is not None:
        print(f"summaries in {args.out_dir}")


if __name__ == "__main__":
    main()
