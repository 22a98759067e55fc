"""LionCub's compressed step: buckets one by one, pipelined, and votes started during backward, on real gloo ranks.

Each rank trains three copies of the 12.9M-parameter GPT of bench_train (4 layers, d_model 512;
sequence 32, batch 4) on the same batches with a 1-bit LionCub each: buckets run serially, pipelined
(the default; see ``LionCub._compressed_step``), and pipelined with ``overlap=True`` (votes started
from gradient hooks during backward). The three take turns, step for step, in a rotating order, so
they see the same machine load. The table gives, per bucket size, the median of backward + step
(what overlap can shorten) and of the step alone, and their ratios to serial. Afterwards the copies'
parameters and momenta are compared bit for bit on every rank. No clipping: overlap's votes are kept.

    python -m benchmarks.bench_step_schedule [--ranks 2] [--steps 20] [--bucket-sizes 8388608,1048576]

Ranks talk over loopback (no shaping): collectives are cheap next to the local work, so this bounds
what the schedules cost or hide on a fast link, not on a slow one; the ranks and gloo's threads share
the machine's cores.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_lioncub import LionCub
from examples.gpt import GPT, GPTConfig

MODEL = GPTConfig(max_seq_len=32, n_layer=4, n_head=8, d_model=512)
BATCH, SEQUENCE = 4, 32
SCHEDULES = ("serial", "pipelined", "overlap")


def make_optimizer(model: GPT, bucket_size: int, schedule: str) -> LionCub:
    optimizer = LionCub(
        model.named_parameters(), lr=1e-4, weight_decay=0.1, bucket_size=bucket_size, overlap=schedule == "overlap"
    )
    optimizer.rank_step.pipelined = schedule != "serial"
    return optimizer


def rank_main(rank: int, world_size: int, store: str, steps: int, bucket_sizes: list[int], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(MODEL)
    rows = []
    for bucket_size in bucket_sizes:
        models = {schedule: copy.deepcopy(model) for schedule in SCHEDULES}
        optimizers = {schedule: make_optimizer(models[schedule], bucket_size, schedule) for schedule in SCHEDULES}
        backward_and_step: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
        step_only: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
        for step in range(steps + 1):
            generator = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQUENCE + 1), generator=generator)
            shift = step % len(SCHEDULES)
            for schedule in SCHEDULES[shift:] + SCHEDULES[:shift]:
                optimizer = optimizers[schedule]
                optimizer.zero_grad()
                logits = models[schedule](tokens[:, :-1])[0]
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                dist.barrier()
                start = time.perf_counter()
                if schedule == "overlap":
                    optimizer.overlap_next_backward()
                loss.backward()
                middle = time.perf_counter()
                optimizer.step()
                end = time.perf_counter()
                if step:  # the first is a warm-up
                    backward_and_step[schedule].append(end - start)
                    step_only[schedule].append(end - middle)
        serial = optimizers["serial"]
        same = all(
            torch.equal(a, b) and torch.equal(serial.state[a]["exp_avg"], optimizers[name].state[b]["exp_avg"])
            for name in SCHEDULES[1:]
            for a, b in zip(models["serial"].parameters(), models[name].parameters(), strict=True)
        )
        rows.append({"bucket_size": bucket_size, "total": backward_and_step, "step": step_only, "same": same})
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-sizes", default=f"{1 << 23},{1 << 20}")
    args = parser.parse_args()
    bucket_sizes = [int(size) for size in args.bucket_sizes.split(",")]
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as work:
        mp.start_processes(
            rank_main,
            args=(args.ranks, os.path.join(work, "store"), args.steps, bucket_sizes, queue),
            nprocs=args.ranks,
            start_method="spawn",
        )
    rows = queue.get()
    params = sum(p.numel() for p in GPT(MODEL).parameters())
    print(f"{params / 1e6:.1f}M parameters, {args.ranks} gloo ranks on loopback, 1 thread each, {args.steps} steps")
    print("| bucket_size | schedule | backward + step ms | / serial | step ms | / serial | bits as serial |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        total = {name: statistics.median(times) * 1e3 for name, times in row["total"].items()}
        step = {name: statistics.median(times) * 1e3 for name, times in row["step"].items()}
        for name in SCHEDULES:
            print(
                f"| {row['bucket_size']} | {name} | {total[name]:.1f} | {total[name] / total['serial']:.3f} | "
                f"{step[name]:.1f} | {step[name] / step['serial']:.3f} | {'yes' if row['same'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
