"""LionCub's compressed step, its buckets run one by one or pipelined, on real gloo ranks.

Each rank builds the 12.9M-parameter GPT of bench_train (4 layers, d_model 512; sequence 32, batch
4), runs one forward and backward for real gradients, and then times ``optimizer.step()`` of two
1-bit LionCubs, each on its own copy of the model and gradients: one with the buckets run serially,
one pipelined (see ``LionCub._compressed_step``). The two alternate, step for step, so both see the
same machine load; the table gives the median step of each and their ratio, per bucket size. After
timing, the copies' parameters and momenta are compared bit for bit on every rank (the schedule must
not change a bit).

    python -m benchmarks.bench_step_schedule [--ranks 2] [--steps 20] [--bucket-sizes 8388608,1048576]

Ranks talk over loopback (no shaping): the collectives are cheap next to the local work, so this
bounds what pipelining costs or hides on a fast link, not on a slow one.
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
SCHEDULES = ("serial", "pipelined")


def make_optimizer(model: GPT, bucket_size: int, schedule: str) -> LionCub:
    optimizer = LionCub(model.named_parameters(), lr=1e-4, weight_decay=0.1, bucket_size=bucket_size)
    optimizer._pipelined_buckets = schedule == "pipelined"
    return optimizer


def copy_with_gradients(model: GPT) -> GPT:
    twin = copy.deepcopy(model)
    for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
        mine.grad = None if theirs.grad is None else theirs.grad.clone()
    return twin


def rank_main(rank: int, world_size: int, store: str, steps: int, bucket_sizes: list[int], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(MODEL)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQUENCE + 1), generator=torch.Generator().manual_seed(rank))
    logits = model(tokens[:, :-1])[0]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    rows = []
    for bucket_size in bucket_sizes:
        models = {schedule: copy_with_gradients(model) for schedule in SCHEDULES}
        optimizers = {schedule: make_optimizer(models[schedule], bucket_size, schedule) for schedule in SCHEDULES}
        times: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
        for step in range(steps + 1):
            order = SCHEDULES if step % 2 == 0 else tuple(reversed(SCHEDULES))
            for schedule in order:
                dist.barrier()
                start = time.perf_counter()
                optimizers[schedule].step()
                if step:  # the first is a warm-up
                    times[schedule].append(time.perf_counter() - start)
        pairs = zip(models["serial"].parameters(), models["pipelined"].parameters(), strict=True)
        same = all(
            torch.equal(a, b)
            and torch.equal(optimizers["serial"].state[a]["exp_avg"], optimizers["pipelined"].state[b]["exp_avg"])
            for a, b in pairs
        )
        rows.append({"bucket_size": bucket_size, "times": times, "same": same})
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
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as work:
        store = os.path.join(work, "store")
        mp.start_processes(
            rank_main,
            args=(args.ranks, store, args.steps, bucket_sizes, queue),
            nprocs=args.ranks,
            start_method="spawn",
        )
    rows = queue.get()
    params = sum(p.numel() for p in GPT(MODEL).parameters())
    print(f"{params / 1e6:.1f}M parameters, {args.ranks} gloo ranks on loopback, 1 thread each, {args.steps} steps")
    print("| bucket_size | buckets | serial ms | pipelined ms | pipelined / serial | params, momenta identical |")
    print("|---:|---:|---:|---:|---:|---|")
    for row in rows:
        serial = statistics.median(row["times"]["serial"]) * 1e3
        pipelined = statistics.median(row["times"]["pipelined"]) * 1e3
        buckets = -(-params // row["bucket_size"])
        print(
            f"| {row['bucket_size']} | >= {buckets} | {serial:.1f} | {pipelined:.1f} | {pipelined / serial:.3f} | "
            f"{'yes' if row['same'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
