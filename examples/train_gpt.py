"""Train the example GPT data-parallel with Lion / Lion Cub on CPU (gloo) or a single process.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --compression 1bit --steps 150
    python examples/train_gpt.py --compression none          # one process, no torch.distributed

Plain torch.distributed, no DeepSpeed engine: the optimizer does all the communication itself
(the gradient average for compression "none", the sign vote otherwise), so comm_stats() counts
every byte the data-parallel step sends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus
from gpt import GPT, GPTConfig

try:
    import ds_lioncub
except ImportError:  # running from a checkout without `pip install -e .`: use the repo's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ds_lioncub


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("optimizer")
    g.add_argument("--compression", choices=("none", "1bit", "kbit"), default="1bit",
                   help="none = exact Lion with averaged gradients; 1bit/kbit = Lion Cub sign vote")
    g.add_argument("--bits", type=int, choices=(2, 4, 8), default=4, help="field width (kbit only)")
    g.add_argument("--quantizer", choices=("sign", "l1"), default="sign", help="kbit only")
    g.add_argument("--comm-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="gradient allreduce dtype (compression none only)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warmup, then cosine decay")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    g.add_argument("--grad-clip", type=float, default=0.0,
                   help="clip each rank's local gradient norm (0 = off); D-Lion clips per worker")

    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=150)
    g.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eval-batches", type=int, default=20, help="validation batches (split over ranks)")
    g.add_argument("--threads", type=int, default=0, help="torch threads per rank (0 = cores / local ranks)")

    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=2)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--d-model", type=int, default=128)

    g = p.add_argument_group("data and output")
    g.add_argument("--corpus", type=Path, default=None, help="training text file (default: Python stdlib sources)")
    g.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap (<= 0: none)")
    g.add_argument("--json-out", type=Path, default=None, help="write a JSON summary here (rank 0)")
    g.add_argument("--log-interval", type=int, default=0, help="log lines when there is no progress bar (0 = steps/10)")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
        p.error("--steps, --batch-size and --seq-len must be >= 1")
    return args


def init_distributed() -> tuple[int, int]:
    """(rank, world_size). torchrun sets these four variables; without them run as one process."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if all(k in os.environ for k in needed):
        dist.init_process_group(backend="gloo")  # env:// rendezvous reads the variables above
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def set_threads(requested: int) -> int:
    # Ranks on one machine share its cores; oversubscribing them makes step times meaningless.
    if requested > 0:
        threads = requested
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, cores // local_ranks)
    torch.set_num_threads(threads)
    return threads


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr, then cosine decay to --lr * --min-lr-ratio. step is 0-based."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = max(1, args.steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (args.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs are bytes [i, i+T), targets the same window shifted by one."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets].long()
    return windows[:, :-1], windows[:, 1:]


def optimizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay, compression=args.compression
    )
    # LionCub validates its options: comm_dtype exists only for "none", bits/quantizer only for "kbit".
    if args.compression == "none":
        kwargs["comm_dtype"] = args.comm_dtype
    elif args.compression == "kbit":
        kwargs["bits"] = args.bits
        kwargs["quantizer"] = args.quantizer
    return kwargs


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, args: argparse.Namespace, rank: int, world: int) -> float:
    """Mean loss over evenly spaced validation windows, the same set whatever the world size.

    Each rank scores every world-th window and the sums are reduced, so evaluation costs
    1/world of the single-process time and the result is identical on all ranks.
    """
    model.eval()
    n_windows = args.eval_batches * args.batch_size
    last_start = len(val) - args.seq_len - 1
    if last_start < 0:
        raise ValueError(f"validation split ({len(val)} bytes) is shorter than --seq-len + 1")
    starts = torch.linspace(0, last_start, n_windows).long()[rank::world]
    offsets = torch.arange(args.seq_len + 1)
    total = torch.zeros(2, dtype=torch.float64)  # (sum of per-window mean losses, windows)
    for chunk in starts.split(args.batch_size):
        windows = val[chunk[:, None] + offsets].long()
        _, loss = model(windows[:, :-1], windows[:, 1:])
        total += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def params_in_sync(model: GPT, world: int) -> bool:
    """True when every rank holds bitwise the same parameters (Lion Cub's guarantee).

    Elementwise MAX and MIN across ranks are equal exactly when all ranks agree.
    """
    if world == 1:
        return True
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def make_progress(enabled: bool, total: int) -> Any:
    """tqdm bar when available and attached to a terminal; None means "print log lines"."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, dynamic_ncols=True, desc="train")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    rank, world = init_distributed()
    threads = set_threads(args.threads)

    corpus: Corpus = load_corpus(args.corpus, max_bytes=args.corpus_bytes)
    if len(corpus.train) <= args.seq_len + 1:
        raise ValueError(f"training split ({len(corpus.train)} bytes) is shorter than --seq-len + 1")

    # Same seed on every rank: identical initial parameters without a broadcast.
    torch.manual_seed(args.seed)
    cfg = GPTConfig(max_seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)
    model = GPT(cfg)
    optimizer = ds_lioncub.LionCub(model.named_parameters(), **optimizer_kwargs(args))

    # Different data per rank (that is what data parallelism is), reproducible per (seed, rank).
    data_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank + 1)

    if rank == 0:
        print(f"[train_gpt] world={world} threads/rank={threads} params={model.num_parameters():,} "
              f"corpus: {corpus.source} (train {len(corpus.train):,} / val {len(corpus.val):,} bytes)", flush=True)
        print(f"[train_gpt] optimizer LionCub({optimizer_kwargs(args)})", flush=True)

    bar = make_progress(rank == 0 and not args.no_progress, args.steps)
    log_every = args.log_interval or max(1, args.steps // 10)
    losses: list[float] = []
    step_times: list[float] = []
    opt_times: list[float] = []
    bytes_per_step: list[int] = []
    start_stats = optimizer.comm_stats()
    t_train = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(corpus.train, args.batch_size, args.seq_len, data_gen)
        _, loss = model(x, y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        before = optimizer.comm_stats().bytes_sent
        t_opt = time.perf_counter()
        optimizer.step()  # includes all communication of the step
        opt_times.append(time.perf_counter() - t_opt)
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        bytes_per_step.append(optimizer.comm_stats().bytes_sent - before)
        losses.append(loss.item())

        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{1e3 * step_times[-1]:.0f}",
                            sent=f"{bytes_per_step[-1] / 1e3:.1f}kB")
        elif rank == 0 and ((step + 1) % log_every == 0 or step + 1 == args.steps):
            print(f"[train_gpt] step {step + 1:5d}/{args.steps} loss {losses[-1]:.4f} lr {lr:.2e} "
                  f"step {1e3 * step_times[-1]:.1f} ms sent {bytes_per_step[-1]:,} B", flush=True)
    train_wall = time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    end_stats = optimizer.comm_stats()

    # Everything below happens after the timed loop, so its communication is not in the numbers.
    val_loss = evaluate(model, corpus.val, args, rank, world)
    tail = min(10, len(losses))  # single-batch losses are noisy: average the last few steps
    per_rank = torch.tensor(
        [sum(losses[-tail:]) / tail,
         end_stats.bytes_sent - start_stats.bytes_sent,
         end_stats.bytes_received - start_stats.bytes_received,
         end_stats.collectives - start_stats.collectives],
        dtype=torch.float64,
    )
    if world > 1:
        dist.all_reduce(per_rank)
        per_rank /= world
    in_sync = params_in_sync(model, world)
    # The first steps include lazy state allocation and allocator warmup; leave them out of the mean.
    skip = min(3, args.steps - 1)
    mean_step = sum(step_times[skip:]) / len(step_times[skip:])
    mean_opt = sum(opt_times[skip:]) / len(opt_times[skip:])

    summary: dict[str, Any] | None = None
    if rank == 0:
        summary = {
            "compression": args.compression,
            "optimizer_kwargs": optimizer_kwargs(args),
            "world_size": world,
            "threads_per_rank": threads,
            "steps": args.steps,
            "batch_size_per_rank": args.batch_size,
            "seq_len": args.seq_len,
            "seed": args.seed,
            "model": asdict(cfg),
            "n_params": model.num_parameters(),
            "corpus": corpus.source,
            "final_train_loss": per_rank[0].item(),  # mean over ranks of the last-10-step mean
            "val_loss": val_loss,
            "mean_step_time_s": mean_step,
            "mean_optimizer_step_time_s": mean_opt,
            "train_wall_s": train_wall,
            # Per rank, averaged over ranks; comm_stats counters are cumulative, so use differences.
            "bytes_sent_per_step": per_rank[1].item() / args.steps,
            "bytes_received_per_step": per_rank[2].item() / args.steps,
            "collectives_per_step": per_rank[3].item() / args.steps,
            "bits_sent_per_param_per_step": 8 * per_rank[1].item() / args.steps / model.num_parameters(),
            "params_in_sync": in_sync,
            "train_loss_rank0": losses,
        }
        print(f"[train_gpt] done: train loss {summary['final_train_loss']:.4f} val loss {val_loss:.4f} "
              f"step {1e3 * mean_step:.1f} ms (optimizer {1e3 * mean_opt:.1f} ms) "
              f"sent {summary['bytes_sent_per_step']:,.0f} B/step/rank params in sync: {in_sync}", flush=True)
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(summary, indent=2) + "\n")

    if world > 1:
        dist.barrier()  # nobody tears down the group while another rank is still reducing
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
