"""What the per-step telemetry costs, next to a LionCub step.

In one process (a world of one: the vote's local work, no collectives), on the parameters of the
12.9M-parameter GPT of bench_train with fixed random gradients, the median time of ``LionCub.step``:

- with ``telemetry.vote_stats`` off (what every step pays: two ``perf_counter`` readings per bucket
  and per collective, two ``comm_stats()`` copies per step) and on (a bool copy of each bucket, a
  count of the tied positions on the received rows, a comparison with the applied signs);
- the always-on part's own price: one ``perf_counter`` reading and one ``comm_stats()`` copy, timed
  alone, times how often a step makes them.

The 8-byte all-reduce that ``vote_stats`` adds at p > 1 is one latency, like the non-finite check's,
and not timed here.

    python -m benchmarks.bench_telemetry [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from typing import Any

import torch

from ds_lioncub import LionCub
from examples.gpt import GPT, GPTConfig

MODEL = GPTConfig(max_seq_len=32, n_layer=4, n_head=8, d_model=512)
MODES: dict[str, dict[str, Any]] = {
    "1bit": {"compression": "1bit"},
    "8bit-l1": {"compression": "kbit", "bits": 8, "quantizer": "l1"},
}
BUCKET_SIZE = 1 << 20  # several buckets per step, as a model larger than one bucket has


def build(options: dict[str, Any], vote_stats: bool) -> LionCub:
    """LionCub over a fresh copy of the model's parameters, each with a fixed random gradient."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    return LionCub(
        model.parameters(),
        lr=1e-6,
        bucket_size=BUCKET_SIZE,
        consistency_check={"interval": 0},
        telemetry={"vote_stats": vote_stats},
        **options,
    )


def step_seconds(options: dict[str, Any], repeats: int) -> tuple[float, float, int]:
    """Median seconds of one step with vote_stats off and on (timed alternately, so that a change in
    the machine's load reaches both alike), and the buckets a step aggregates."""
    off, on = build(options, False), build(options, True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(repeats + 1):
        for vote_stats, optimizer in ((False, off), (True, on)):
            start = time.perf_counter()
            optimizer.step()
            if repeat:  # the first round warms up
                times[vote_stats].append(time.perf_counter() - start)
    record = on.last_step_telemetry
    assert record is not None and record.tie_rate is not None
    return statistics.median(times[False]), statistics.median(times[True]), record.buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parameters = sum(p.numel() for p in GPT(MODEL).parameters())
    print(f"{parameters} parameters, bucket_size {BUCKET_SIZE}, {args.threads} thread(s), median of {args.repeats}")
    optimizer = LionCub([torch.nn.Parameter(torch.zeros(8))])
    reading = timeit.timeit(time.perf_counter, number=100_000) / 100_000
    snapshot = timeit.timeit(optimizer.comm_stats, number=100_000) / 100_000
    print(f"one perf_counter reading {reading * 1e9:.0f} ns, one comm_stats() copy {snapshot * 1e9:.0f} ns")
    print("| mode | buckets | step, vote_stats off | step, vote_stats on | on / off | always-on part / step |")
    print("|---|---|---|---|---|---|")
    for name, options in MODES.items():
        off, on, buckets = step_seconds(options, args.repeats)
        # Per step: 2 readings per bucket, 2 per collective (at most 2 per bucket + 1), 2 comm_stats() copies.
        always_on = (2 * buckets + 2 * (2 * buckets + 1)) * reading + 2 * snapshot
        print(
            f"| {name} | {buckets} | {off * 1e3:.2f} ms | {on * 1e3:.2f} ms | {on / off:.3f} | "
            f"{always_on / off * 100:.4f} % |"
        )


if __name__ == "__main__":
    main()
