"""Train the example GPT as a DeepSpeed job: Lion / Lion Cub come from the ds_config.

    PYTHONPATH=. deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config configs/lioncub_1bit.json --steps 150
    python -m examples.compare          # four configs side by side, same seed, steps and model

Run from the repository root. The launcher starts this file by path on every rank, and the ranks
import ``examples.gpt``, ``examples.corpus`` and this checkout's ds_lioncub through PYTHONPATH
(``python -m examples.compare`` sets it for the runs it starts).

`import ds_lioncub` registers "type": "LionCub", so the optimizer, its compression, the precision,
the micro-batch size, gradient accumulation and the lr scheduler are all the ds_config's; this
script's own options only choose the model, the data and the length of the run. On CPU
(DS_ACCELERATOR=cpu) the ranks talk over gloo.

Bytes per step per rank have two sources, added up: LionCub's compressed collectives (its own
comm_stats(), over torch.distributed) and the all-reduces the DeepSpeed engine issues itself through
deepspeed.comm (its gradient average for compression "none"), counted here by wrapping
deepspeed.comm.all_reduce.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

import ds_lioncub  # noqa: F401  (registers "type": "LionCub" with DeepSpeed)
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.integration import find_lioncub
from examples.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus
from examples.gpt import GPT, GPTConfig

# Torch threads per rank unless --threads says otherwise: see set_threads. 1 is what the README's table ran
# with on its 2-core machine (2 ranks x cores / 2), so its numbers stand.
DEFAULT_THREADS = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The launcher appends --local_rank=N to every rank's command line.
    p.add_argument(
        "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")), help="set by the deepspeed launcher"
    )

    g = p.add_argument_group("training (batch size, accumulation, optimizer and lr schedule: see the ds_config)")
    g.add_argument("--steps", type=int, default=150, help="optimizer steps")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--eval-windows",
        type=int,
        default=320,
        help="validation windows, evenly spaced (split over ranks; the same set for every config)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"torch threads per rank (default {DEFAULT_THREADS}, whatever the machine; 0 = cores / local ranks: "
        "faster on a large machine, but the losses then depend on its core count)",
    )

    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=2)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--d-model", type=int, default=128)

    g = p.add_argument_group("data and output")
    g.add_argument("--corpus", type=Path, default=None, help="training text file (default: DeepSpeed 0.19.8 sources)")
    g.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap (<= 0: none)")
    g.add_argument("--json-out", type=Path, default=None, help="write a JSON summary here (rank 0)")
    g.add_argument("--log-interval", type=int, default=0, help="log lines when there is no progress bar (0 = steps/10)")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument(
        "--ds-log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="DeepSpeed's own logger (info prints the config dump and lr every steps_per_print)",
    )

    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        p.error("--deepspeed_config is required (for example configs/lioncub_1bit.json)")
    try:
        # Read here, before any rank joins the process group: a bad file stops every rank with the same message.
        args.ds_config = read_ds_config(Path(args.deepspeed_config))
    except ValueError as error:
        p.error(str(error))
    if args.steps < 1 or args.seq_len < 1 or args.eval_windows < 1:
        p.error("--steps, --seq-len and --eval-windows must be >= 1")
    return args


def read_ds_config(path: Path) -> dict[str, Any]:
    """The ds_config at ``path``; ValueError naming the file (and the line and column) if it cannot be used."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--deepspeed_config {path}: cannot read it ({error.strerror or error})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--deepspeed_config {path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {path} must hold a JSON object ({{...}}), not {type(config).__name__}")
    return config


def set_threads(requested: int) -> int:
    # A fixed count by default, not one derived from the cores: MKL splits the sum over a batch's tokens
    # in a weight gradient (dW = dY^T X) by thread count, so the gradients' last bits, then after a few
    # dozen steps a Lion sign and from there the losses, depend on it (benchmarks/RESULTS.md,
    # "make train across thread counts"). 0 still gives the faster cores / local ranks. Ranks on one
    # machine share its cores; oversubscribing them makes step times meaningless.
    if requested > 0:
        threads = requested
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # LOCAL_SIZE: the deepspeed launcher; LOCAL_WORLD_SIZE: torchrun.
        local_ranks = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        threads = max(1, cores // local_ranks)
    torch.set_num_threads(threads)
    return threads


class EngineAllReduceBytes:
    """Bytes this rank sends in the all-reduces the DeepSpeed engine issues through deepspeed.comm.

    Why a wrapper: LionCub counts its own traffic (comm_stats(), and it calls torch.distributed
    directly, so nothing is counted twice), but the engine's gradient all-reduce (compression "none":
    allreduce_bucket in engine.py) and its small bookkeeping reductions go through
    deepspeed.comm.all_reduce, which counts nothing unless DeepSpeed's comms logger is configured.
    The engine looks the function up on the module at call time (`dist.all_reduce(...)`), so
    replacing the module attribute sees every call. Same convention as
    ds_lioncub.comm.transport.TorchTransport: a bandwidth-optimal (ring) all-reduce sends
    2 * (p - 1) / p * tensor bytes per rank (and receives as much).
    """

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0
        self._original = ds_comm.all_reduce

        def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
            # deepspeed.comm.all_reduce(tensor, op=SUM, group=None, ...); its timing decorator hides
            # the signature from inspect, so the positions are spelled out.
            tensor: torch.Tensor = args[0] if args else kwargs["tensor"]
            group = args[2] if len(args) > 2 else kwargs.get("group")
            world = ds_comm.get_world_size(group=group)
            if world > 1:
                self.calls += 1
                self.bytes_sent += 2 * tensor.numel() * tensor.element_size() * (world - 1) // world
            return self._original(*args, **kwargs)

        ds_comm.all_reduce = counting_all_reduce

    def remove(self) -> None:
        ds_comm.all_reduce = self._original


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs are bytes [i, i+T), targets the same window shifted by one."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets].long()
    return windows[:, :-1], windows[:, 1:]


def fp32_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Under bf16 the module (and its logits) are bf16 while the optimizer keeps fp32 master copies;
    # a bf16 cross-entropy would round the loss to ~3 digits, too coarse to compare runs by. The
    # loss (and its gradient into the logits) is computed in fp32 in every precision.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(
    module: torch.nn.Module,
    val: torch.Tensor,
    batch_size: int,
    args: argparse.Namespace,
    device: torch.device,
    rank: int,
    world: int,
) -> float:
    """Mean loss over evenly spaced validation windows, the same set whatever the world size.

    Each rank scores every world-th window and the sums are reduced, so evaluation costs
    1/world of the single-process time and the result is identical on all ranks.
    """
    module.eval()
    # A fixed window count, not a number of micro-batches: configs with different micro-batch
    # sizes must score the same windows for their val losses to be comparable.
    n_windows = args.eval_windows
    last_start = len(val) - args.seq_len - 1
    if last_start < 0:
        raise ValueError(f"validation split ({len(val)} bytes) is shorter than --seq-len + 1")
    starts = torch.linspace(0, last_start, n_windows).long()[rank::world]
    offsets = torch.arange(args.seq_len + 1)
    total = torch.zeros(2, dtype=torch.float64)  # (sum of per-window mean losses, windows)
    for chunk in starts.split(batch_size):
        windows = val[chunk[:, None] + offsets].long().to(device)
        logits, _ = module(windows[:, :-1])
        loss = fp32_loss(logits, windows[:, 1:])
        total += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
    module.train()
    return (total[0] / total[1]).item()


def checked_parameters(engine: Any) -> list[torch.Tensor]:
    """The module's parameters and, under bf16/fp16, the optimizer's fp32 master copies too.

    Both must agree across ranks: the master copies are what LionCub updates, the module's
    low-precision parameters are what the next forward pass uses.
    """
    tensors = list(engine.module.parameters())
    seen = {id(p) for p in tensors}
    lioncub = find_lioncub(engine.optimizer)
    if lioncub is not None:
        tensors += [p for group in lioncub.param_groups for p in group["params"] if id(p) not in seen]
    return tensors


def params_in_sync(tensors: list[torch.Tensor], world: int) -> bool:
    """True when every rank holds bitwise the same values (Lion Cub's guarantee).

    Elementwise MAX and MIN across ranks are equal exactly when all ranks agree. fp32 holds bf16
    and fp16 values exactly, so the comparison in fp32 is still bitwise.
    """
    if world == 1:
        return True
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def make_progress(enabled: bool, total: int) -> Any:
    """tqdm bar when attached to a terminal; None means "print log lines".

    In a log file or a pipe a bar is a single line of carriage returns, so plain lines read better.
    """
    if not enabled or not sys.stderr.isatty():
        return None
    if os.get_terminal_size(sys.stderr.fileno()).columns == 0:
        return None  # a pseudo-terminal without a size (script, some CI runners): tqdm would draw nothing
    from tqdm import tqdm

    return tqdm(total=total, dynamic_ncols=True, desc="train")


def describe_precision(ds_config: dict[str, Any]) -> str:
    for key in ("bf16", "fp16"):
        if ds_config.get(key, {}).get("enabled", False):
            return key
    return "fp32"


def clipping_of(engine: Any, lioncub: Any) -> str:
    """Which clipping the job ran, as LionCub decided it (its one log line says the same): the mean gradient's
    sketched norm (a compressed mode's default), or DeepSpeed's gradient_clipping, or none."""
    mean = None if lioncub is None else lioncub.options.mean_clip
    if mean is not None:
        return f"LionCub: the ranks' mean gradient at {mean.max_norm:g}, its norm from a {mean.sketch_bins}-bin sketch"
    clipping = float(engine.gradient_clipping() or 0.0)
    return f"DeepSpeed's gradient_clipping at {clipping:g}" if clipping > 0 else "none"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(args.ds_log_level.upper())
    accelerator = get_accelerator()
    # gloo on CPU (no oneCCL here); the accelerator's own backend (nccl, ...) elsewhere.
    backend = "gloo" if accelerator.device_name() == "cpu" else accelerator.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = set_threads(args.threads)
    ds_config: dict[str, Any] = args.ds_config

    corpus: Corpus = load_corpus(args.corpus, max_bytes=args.corpus_bytes)
    if len(corpus.train) <= args.seq_len + 1:
        raise ValueError(f"training split ({len(corpus.train)} bytes) is shorter than --seq-len + 1")

    # Same seed on every rank; deepspeed.initialize also broadcasts rank 0's parameters.
    torch.manual_seed(args.seed)
    cfg = GPTConfig(max_seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)
    model = GPT(cfg)
    n_params = model.num_parameters()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    lioncub = find_lioncub(engine.optimizer)  # None for a non-LionCub config: then only the engine talks

    def lioncub_stats() -> CommStats:
        return lioncub.comm_stats() if lioncub is not None else CommStats()

    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    precision = describe_precision(ds_config)
    optimizer_block = ds_config.get("optimizer", {})
    scheduler_block = ds_config.get("scheduler")
    engine_bytes = EngineAllReduceBytes()  # after initialize: only training-time traffic matters

    # Different data per rank (that is what data parallelism is), reproducible per (seed, rank).
    data_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank + 1)

    if rank == 0:
        schedule = (
            f"{scheduler_block['type']} {scheduler_block.get('params', {})}"
            if scheduler_block
            else "constant (no scheduler block)"
        )
        print(
            f"[train_gpt] {args.deepspeed_config}: world={world} threads/rank={threads} params={n_params:,} "
            f"micro-batch {micro_batch} x accumulation {accumulation} x seq {args.seq_len} per rank, "
            f"precision {precision}",
            flush=True,
        )
        print(
            f"[train_gpt] optimizer {optimizer_block.get('type')} {optimizer_block.get('params', {})}; "
            f"lr schedule: {schedule}",
            flush=True,
        )
        print(
            f"[train_gpt] corpus: {corpus.source} (train {len(corpus.train):,} / val {len(corpus.val):,} bytes)",
            flush=True,
        )

    bar = make_progress(rank == 0 and not args.no_progress, args.steps)
    log_every = args.log_interval or max(1, args.steps // 10)
    losses: list[float] = []
    lrs: list[float] = []
    step_times: list[float] = []
    # engine.step() alone (DeepSpeed's wrapper, its clipping, LionCub's step): what the clip and the vote cost.
    optimizer_times: list[float] = []
    lioncub_bytes: list[int] = []
    engine_bytes_per_step: list[int] = []
    engine_calls_before = engine_bytes.calls
    lioncub_start = lioncub_stats()
    t_train = time.perf_counter()
    for step in range(args.steps):
        lrs.append(float(engine.get_lr()[0]))  # the lr this step applies (the scheduler steps after it)
        sent_lioncub = lioncub_stats().bytes_sent
        sent_engine = engine_bytes.bytes_sent
        t0 = time.perf_counter()
        step_loss = 0.0
        optimizer_time = 0.0
        for _ in range(accumulation):
            x, y = get_batch(corpus.train, micro_batch, args.seq_len, data_gen)
            logits, _ = engine(x.to(engine.device))
            loss = fp32_loss(logits, y.to(engine.device))
            engine.backward(loss)  # divides by the accumulation steps; all-reduces at the boundary
            t_step = time.perf_counter()
            engine.step()  # steps the optimizer (and the scheduler) only at the boundary
            optimizer_time += time.perf_counter() - t_step
            step_loss += loss.item() / accumulation
        step_times.append(time.perf_counter() - t0)
        optimizer_times.append(optimizer_time)
        lioncub_bytes.append(lioncub_stats().bytes_sent - sent_lioncub)
        engine_bytes_per_step.append(engine_bytes.bytes_sent - sent_engine)
        losses.append(step_loss)

        sent = lioncub_bytes[-1] + engine_bytes_per_step[-1]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{1e3 * step_times[-1]:.0f}", sent=f"{sent / 1e3:.1f}kB")
        elif rank == 0 and ((step + 1) % log_every == 0 or step + 1 == args.steps):
            print(
                f"[train_gpt] step {step + 1:5d}/{args.steps} loss {losses[-1]:.4f} lr {lrs[-1]:.2e} "
                f"step {1e3 * step_times[-1]:.1f} ms sent {sent:,} B",
                flush=True,
            )
    train_wall = time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    engine_calls = engine_bytes.calls - engine_calls_before
    engine_bytes.remove()  # evaluation and the checks below are not training traffic
    lioncub_collectives = (lioncub_stats() - lioncub_start).collectives

    val_loss = evaluate(engine.module, corpus.val, micro_batch, args, engine.device, rank, world)
    tail = min(10, len(losses))  # single-batch losses are noisy: average the last few steps
    per_rank = torch.tensor(
        [sum(losses[-tail:]) / tail, sum(lioncub_bytes), sum(engine_bytes_per_step), lioncub_collectives, engine_calls],
        dtype=torch.float64,
    )
    if world > 1:
        dist.all_reduce(per_rank)
        per_rank /= world
    checked = checked_parameters(engine)
    in_sync = params_in_sync(checked, world)
    # The first steps include lazy state allocation and allocator warmup; leave them out of the mean.
    skip = min(3, args.steps - 1)
    mean_step = sum(step_times[skip:]) / len(step_times[skip:])
    mean_optimizer_step = sum(optimizer_times[skip:]) / len(optimizer_times[skip:])

    summary: dict[str, Any] | None = None
    if rank == 0:
        lioncub_per_step = per_rank[1].item() / args.steps
        engine_per_step = per_rank[2].item() / args.steps
        total_per_step = lioncub_per_step + engine_per_step
        summary = {
            "deepspeed_config": str(args.deepspeed_config),
            "ds_config": ds_config,
            "optimizer": optimizer_block.get("type"),
            "optimizer_params": optimizer_block.get("params", {}),
            "compression": lioncub.options.compression if lioncub is not None else None,
            "scheduler": scheduler_block,
            "precision": precision,
            "gradient_clipping": engine.gradient_clipping(),
            "clipping": clipping_of(engine, lioncub),
            "world_size": world,
            "threads_per_rank": threads,
            "steps": args.steps,
            "micro_batch_per_rank": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "sequences_per_step_per_rank": micro_batch * accumulation,
            "seq_len": args.seq_len,
            "seed": args.seed,
            "model": asdict(cfg),
            "n_params": n_params,
            "corpus": corpus.source,
            "final_train_loss": per_rank[0].item(),  # mean over ranks of the last-10-step mean
            "val_loss": val_loss,
            "lr_first": lrs[0],
            "lr_last": lrs[-1],
            "mean_step_time_s": mean_step,
            "mean_optimizer_step_time_s": mean_optimizer_step,
            "train_wall_s": train_wall,
            # Per rank, averaged over ranks, per optimizer step.
            "lioncub_bytes_sent_per_step": lioncub_per_step,
            "engine_allreduce_bytes_sent_per_step": engine_per_step,
            "bytes_sent_per_step": total_per_step,
            "lioncub_collectives_per_step": per_rank[3].item() / args.steps,
            "engine_allreduces_per_step": per_rank[4].item() / args.steps,
            "bits_sent_per_param_per_step": 8 * total_per_step / n_params,
            "params_in_sync": in_sync,
            "checked_tensors": len(checked),
            "train_loss_rank0": losses,
        }
        print(
            f"[train_gpt] done: train loss {summary['final_train_loss']:.4f} val loss {val_loss:.4f} "
            f"step {1e3 * mean_step:.1f} ms sent {total_per_step:,.0f} B/step/rank "
            f"(LionCub {lioncub_per_step:,.0f}, engine all-reduce {engine_per_step:,.0f}) "
            f"= {summary['bits_sent_per_param_per_step']:.3f} bits/param; params in sync across ranks: {in_sync}",
            flush=True,
        )
        if lrs[0] == 0.0 and scheduler_block:
            # Not ours to fix: DeepSpeed's WarmupCosineLR sets lr 0 at construction (its "before it has
            # started" warning) and only moves to the warmup lr after the first step.
            print(
                f"[train_gpt] note: {scheduler_block['type']} ran the first step at lr 0 (DeepSpeed's "
                f"scheduler starts there); that step only updated the momentum",
                flush=True,
            )
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(summary, indent=2) + "\n")

    if world > 1:
        dist.barrier()  # nobody tears down the group while another rank is still reducing
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
