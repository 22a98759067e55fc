"""Lion (fp32 all-reduce) vs Lion Cub 1-bit, 4-bit sign and 8-bit L1, as real DeepSpeed jobs.

    python -m examples.compare                 # defaults: 2 ranks (CPU under make train), 4-7 minutes on 2 busy cores
    python -m examples.compare --steps 600 --d-model 256 --out-dir runs/
    python -m examples.compare --as-is         # each ds_config exactly as written in configs/

(from the repository root). Each config runs examples/train_gpt.py under the deepspeed launcher
(python -m deepspeed.launcher.runner --num_gpus N) as a fresh job, with the same seed, steps, model
and corpus (built once and shared, so every run trains on identical bytes).

The four configs differ in more than their communication: lioncub_1bit has a WarmupLR schedule,
lioncub_4bit_sign runs in bf16 with a WarmupCosineLR over 200 steps, lioncub_8bit_l1 uses
micro-batch 8 x accumulation 2, lion_fp32 has a constant lr. Comparing them as written would mix
those effects into the losses and step times. So by default each run gets a temporary copy of its
config in which everything but the optimizer's communication is common (see COMMON below);
--as-is runs the files unchanged instead and says what each of them does.

After the measured table it prints the planner's predictions for the same configurations on real
networks (clearly labelled: on one machine communication is a loopback copy, so the measured step
times cannot show what compression saves): for this model on machines of one CPU rank each, priced
with the planner's CPU table, and for a 1.3B-parameter model on 4 nodes x 8 H100s, priced with its
measured H100 table, with the planner's recommendation there. It then writes the loss curves to a
PNG: the predictions come from examples/compare_report.py, the plot from examples/compare_plot.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.compare_plot import write_loss_plot
from examples.compare_report import RunConfig, communication_params, prediction_report
from examples.corpus import DEFAULT_MAX_BYTES, build_corpus

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_gpt.py"
CONFIG_DIR = REPO / "configs"
PLOT_DEFAULT = REPO / "runs" / "compare_loss_curves.png"  # runs/ is git-ignored
# The deepspeed launcher sometimes aborts at exit after the work is done ("terminate called without
# an active exception"); a run that wrote its summary and then exited with this code succeeded.
LAUNCHER_EXIT_AFTER_WORK = 250


@dataclass(frozen=True)
class Method:
    config: str  # file name in configs/, without .json
    label: str


METHODS: tuple[Method, ...] = (
    Method("lion_fp32", "Lion, fp32 all-reduce"),  # the baseline: the ratio column divides by it
    Method("lioncub_1bit", "Lion Cub 1-bit vote"),
    Method("lioncub_4bit_sign", "Lion Cub 4-bit sign"),
    Method("lioncub_8bit_l1", "Lion Cub 8-bit L1"),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: train_gpt.py's, 1 on any machine, so the losses repeat from machine "
        "to machine; 0 = cores / ranks, faster on a large machine, but the losses then depend on its core count)",
    )
    g = p.add_argument_group("common settings (ignored with --as-is)")
    g.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per step (accumulation 1)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak lr of the common schedule")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warmup, then cosine decay to lr / 10")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient_clipping (DeepSpeed's default is 1.0)")
    g.add_argument(
        "--as-is",
        action="store_true",
        help="run the configs unchanged (they differ in more than communication: schedule, precision, batch layout)",
    )
    p.add_argument("--corpus", type=Path, default=None, help="training text file (default: DeepSpeed 0.19.8 sources)")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--out-dir", type=Path, default=None, help="keep per-run JSON summaries and configs here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="loss-curve PNG (default: loss_curves.png in --out-dir, else runs/compare_loss_curves.png)",
    )
    return p.parse_args()


def common_config(original: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``original`` with everything but the optimizer's communication made equal across runs.

    Kept from the file: the optimizer block (compression, bits, quantizer, betas, weight decay;
    only lr is set, to the common peak) and communication_data_type. Made common: the batch layout,
    the lr schedule (DeepSpeed's WarmupCosineLR, stepped by the engine), gradient clipping, and the
    precision (fp32: bf16 is a compute setting, and on this CPU it is ~8x slower, which would
    swamp the step-time column).
    """
    config = copy.deepcopy(original)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = 1
    config.pop("train_batch_size", None)  # derived from the two above; a stale value would conflict
    config["gradient_clipping"] = args.grad_clip
    config.pop("bf16", None)
    config.pop("fp16", None)
    config["optimizer"]["params"]["lr"] = args.lr
    config["scheduler"] = {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": args.steps,
            "warmup_num_steps": args.warmup_steps,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.1,
        },
    }
    return config


def free_port() -> int:
    """A TCP port free on this machine now: each job gets its own rendezvous port (a previous job's port may
    still be in TIME_WAIT). The tests and benchmarks that start jobs use this one too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def remove_deepspeed_shm_buffers(port: int) -> None:
    """Delete the shared-memory buffers a finished DeepSpeed CPU job that rendezvoused on ``port`` left behind.

    DeepSpeed's CPU communication (its ``shm`` op) creates one buffer of about 67 MB per rank in
    /dev/shm, named ``deepspeed_allreduce_buffer_<uid>_<address>_<port>_<rank>``, and never unlinks it,
    so every job leaves its ranks' buffers in memory until the machine restarts (a test suite's worth
    fills /dev/shm). Call this once the job's processes have exited.
    """
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        path.unlink(missing_ok=True)


def run_method(
    method: Method, config_path: Path, common: list[str], args: argparse.Namespace, out_dir: Path
) -> dict[str, Any]:
    json_out = out_dir / f"{method.config}.json"
    json_out.unlink(missing_ok=True)  # a stale summary must never pass for this run's result
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(args.nproc),
        "--master_port",
        str(port := free_port()),
        "--log_level",
        "warning",
        str(TRAIN_SCRIPT),
        "--deepspeed_config",
        str(config_path),
        *common,
        "--json-out",
        str(json_out),
    ]
    print(f"\n=== {method.config}: {method.label} ===\n$ {' '.join(cmd)}", flush=True)
    env = {
        **os.environ,
        # The ranks import ds_lioncub from this checkout even when it is not pip-installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # The ranks JIT-build (or reuse) DeepSpeed's CPU shm op and LionCub's packing op with the first
        # `ninja` on PATH. Without an activated venv that is the system's (1.11 here), with one the
        # venv's (1.13); the two record different command hashes in the shared build log, so each
        # switch rebuilds both ops (100-250 s on a busy 2-core machine). Put this interpreter's
        # environment first, as an activated venv does.
        "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.timeout, env=env)
    finally:
        remove_deepspeed_shm_buffers(port)
    wall = time.perf_counter() - t0
    done = json_out.exists()
    if proc.returncode == LAUNCHER_EXIT_AFTER_WORK and done:
        print(
            f"note: the deepspeed launcher exited with code {proc.returncode} after the run wrote its "
            f"summary (a known teardown abort); the results are complete",
            flush=True,
        )
    elif proc.returncode != 0 or not done:
        raise SystemExit(
            f"{method.config}: run failed (exit code {proc.returncode}"
            f"{'' if done else ', no summary at ' + str(json_out)})"
        )
    summary: dict[str, Any] = json.loads(json_out.read_text())
    summary["job_wall_s"] = wall
    return summary


def describe(config: dict[str, Any]) -> str:
    """One line: what a config sets besides its optimizer's communication."""
    precision = next((key for key in ("bf16", "fp16") if config.get(key, {}).get("enabled")), "fp32")
    scheduler = config.get("scheduler")
    schedule = f"{scheduler['type']} {json.dumps(scheduler.get('params', {}))}" if scheduler else "constant lr"
    params = config["optimizer"]["params"]
    return (
        f"micro-batch {config.get('train_micro_batch_size_per_gpu')} x accumulation "
        f"{config.get('gradient_accumulation_steps', 1)}, {precision}, lr {params.get('lr')} betas "
        f"{params.get('betas')} wd {params.get('weight_decay')}, {schedule}, gradient_clipping "
        f"{config.get('gradient_clipping', '1.0 (default)')}"
    )


def print_table(results: list[tuple[Method, dict[str, Any]]]) -> None:
    baseline = results[0][1]["bytes_sent_per_step"]
    header = (
        f"{'config':<18} {'method':<22} {'train loss':>10} {'val loss':>9} {'step ms':>8} "
        f"{'bytes/step/rank':>16} {'bits/param':>10} {'vs fp32 Lion':>12} {'in sync':>7}"
    )
    print(header)
    print("-" * len(header))
    for method, r in results:
        ratio = r["bytes_sent_per_step"] / baseline if baseline > 0 else float("nan")
        print(
            f"{method.config:<18} {method.label:<22} {r['final_train_loss']:>10.4f} {r['val_loss']:>9.4f} "
            f"{1e3 * r['mean_step_time_s']:>8.1f} {r['bytes_sent_per_step']:>16,.0f} "
            f"{r['bits_sent_per_param_per_step']:>10.3f} {f'1/{1 / ratio:.1f}' if ratio > 0 else '-':>12} "
            f"{'yes' if r['params_in_sync'] else 'NO':>7}"
        )


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

        configs: dict[str, tuple[Path, dict[str, Any]]] = {}
        for method in METHODS:
            original_path = CONFIG_DIR / f"{method.config}.json"
            original = json.loads(original_path.read_text())
            if args.as_is:
                configs[method.config] = (original_path, original)
            else:
                config = common_config(original, args)
                path = out_dir / f"{method.config}.ds_config.json"
                path.write_text(json.dumps(config, indent=2) + "\n")
                configs[method.config] = (path, config)

        if not args.as_is:
            # The optimizer blocks are kept as written; say so if they differ in more than communication.
            hyper = {
                m.config: {k: configs[m.config][1]["optimizer"]["params"].get(k) for k in ("betas", "weight_decay")}
                for m in METHODS
            }
            if len({json.dumps(h, sort_keys=True) for h in hyper.values()}) > 1:
                print(f"warning: the configs' betas / weight decay differ, so this is not like for like: {hyper}")

        common = [
            "--steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
            "--seed",
            str(args.seed),
            "--n-layer",
            str(args.n_layer),
            "--n-head",
            str(args.n_head),
            "--d-model",
            str(args.d_model),
            "--corpus",
            str(corpus_path),
            "--corpus-bytes",
            "0",
            *([] if args.threads is None else ["--threads", str(args.threads)]),
        ]
        results = [(m, run_method(m, configs[m.config][0], common, args, out_dir)) for m in METHODS]

    first = results[0][1]
    # What DeepSpeed's accelerator ran the ranks on (DS_ACCELERATOR, else CUDA where torch sees it), as "auto" plans.
    from ds_lioncub.planner.devices import this_machines_device  # here: the jobs above need none of ds_lioncub

    device = this_machines_device()
    print(
        f"\n{args.nproc} {device.upper()} ranks x {first['threads_per_rank']} thread(s), {args.steps} optimizer steps, "
        f"seq len {args.seq_len}, {first['n_params']:,} params, seed {args.seed}, same corpus for every run"
    )
    if args.as_is:
        print(
            "configs run as written; they differ in more than communication, so losses and step times "
            "are not a like-for-like comparison:"
        )
        for method in METHODS:
            print(f"  {method.config}: {describe(configs[method.config][1])}")
    else:
        print(
            "fair comparison: each config ran as a temporary copy that keeps its optimizer block "
            "(compression, bits, quantizer, betas, weight decay) and sets the rest in common:"
        )
        print(f"  {describe(configs[METHODS[0].config][1])}")
        print(
            "  (the files in configs/ differ: lioncub_1bit WarmupLR, lioncub_4bit_sign bf16 + WarmupCosineLR "
            "to step 200,\n   lioncub_8bit_l1 micro-batch 8 x accumulation 2, lion_fp32 constant lr; "
            "--as-is runs them unchanged)"
        )
    print("train loss: mean of the last 10 steps, averaged over ranks; val loss: held-out corpus blocks;")
    print("step ms: mean wall time per optimizer step after 3 warmup steps (noisy on a shared machine);")
    print("bytes/step/rank: sent per optimizer step per rank = LionCub's comm_stats() + the engine's own")
    print("  deepspeed.comm.all_reduce traffic (its gradient all-reduce for compression none; a few-byte")
    print("  norm/overflow check otherwise), all-reduce counted as 2*(p-1)/p * bytes;")
    print("bits/param: 8 * bytes/step/rank / params; vs fp32 Lion: that ratio to the lion_fp32 row\n")
    print_table(results)
    # Which clipping each job ran: a compressed mode clips the ranks' mean gradient by its sketched norm, as exact
    # Lion's engine clips its averaged gradient (ds_lioncub/config/clip_rule.py).
    print("\nclipping:")
    for method, r in results:
        print(f"  {method.config:<18} {r.get('clipping', '-')}")
    by_config = {m.config: r for m, r in results}
    one_bit, four_bit = by_config.get("lioncub_1bit"), by_config.get("lioncub_4bit_sign")
    if one_bit is not None and four_bit is not None and one_bit["train_loss_rank0"] == four_bit["train_loss_rank0"]:
        # Not a bug that the two rows match: both compute sign(sum of the ranks' signs) with the
        # same tie rule, only encoded differently (packed bits + all-to-all vs 4-bit field sums).
        print(
            "\nnote: the 1-bit and 4-bit sign rows train identically: both are the same majority vote of the\n"
            "      ranks' signs (same tie rule), sent as packed bits vs summed 4-bit fields; only bytes and "
            "time differ"
        )

    runs = [RunConfig(m.config, m.label, communication_params(r)) for m, r in results]
    print("\n" + prediction_report(runs, first["n_params"], args.nproc, device))

    plot = args.plot or (args.out_dir / "loss_curves.png" if args.out_dir is not None else PLOT_DEFAULT)
    write_loss_plot(
        [(f"{m.config}: {m.label}", r["train_loss_rank0"]) for m, r in results],
        plot,
        f"{first['n_params']:,}-param GPT, {args.nproc} {device.upper()} ranks, seed {args.seed}",
    )
    print(f"\nloss curves (train loss per step, rank 0): {plot}")

    walls = ", ".join(f"{m.config} {r['job_wall_s']:.1f}s" for m, r in results)
    print(f"\njob wall times (launcher start to exit): {walls}; total {time.perf_counter() - t_start:.1f}s")
    if args.out_dir is not None:
        print(f"summaries and the configs that ran are in {args.out_dir}")


if __name__ == "__main__":
    main()
