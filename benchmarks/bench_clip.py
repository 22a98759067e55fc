"""Option clip's local cost: the sketch of a bucket's gradient and the scaling of it, in units of Lion's update.

    python -m benchmarks.bench_clip [--numel 8388608 ...] [--repeats 7] [--bins 4093] [--device cpu|cuda]

On one bucket of ``--numel`` fp32 elements (each size in turn), one torch thread, the median of ``--repeats``
rounds (each: one call of Lion's update, of the sketch and of the scaling, each after a warm-up call, so that
load falls on all alike), in ns per element and in units of Lion's own update (direction, momentum, update:
the planner table's ``lion_update``, timed here as ``benchmarks/bench_error_feedback.py`` times it): the
sketch (:func:`ds_lioncub.step.clipping.gradient_sketch`: one read of the gradient, a product with the signs
and the sums of its bins) and the scaling of the gradient by the factor (one read and write). Their sum, in
Lion updates, is what the planner adds per stepped element (``CLIP_LOCAL_PASSES``, by device); the
all-reduce of the sketch is priced as a collective. On ``--device cuda`` the bucket lives on the GPU and
each call is timed from an idle device to the end of its kernels; the sketch's table of signs is made once,
before the timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.timing import lion_update_unit, median_seconds
from ds_lioncub.step.clipping import gradient_sketch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 23])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bins", type=int, default=4093)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu, one thread'}")
    print(
        "| elements | lion_update, ns/element | in lion_updates: sketch | scaling | clip (both) "
        "| clip / lion_update, median of rounds |"
    )
    print("|---|---|---|---|---|---|")
    for n in args.numel:
        print(bucket_row(n, args.bins, args.repeats, device))


def bucket_row(n: int, bins: int, repeats: int, device: torch.device) -> str:
    """One table row: the three parts' costs on an ``n``-element bucket, the sketch's and the scaling's also in
    units of Lion's update."""
    lion, _, grad = lion_update_unit(n, device)
    step = iter(range(1, 1 << 30))
    parts = {
        "lion": lion,
        "sketch": lambda: gradient_sketch([[grad]], bins, next(step), 0),
        "scaling": lambda: torch._foreach_mul_([grad], 1.0 - 1e-7),
    }
    # Interleaved, one call of each per round, so that a shared machine's load falls on all three alike.
    rounds = [{name: median_seconds(run, 1, device) / n for name, run in parts.items()} for _ in range(repeats)]
    lion_update, sketch, scale = (statistics.median(r[name] for r in rounds) for name in parts)
    ratio = statistics.median((r["sketch"] + r["scaling"]) / r["lion"] for r in rounds)
    costs = " | ".join(f"{cost / lion_update:.2f}" for cost in (sketch, scale, sketch + scale))
    return f"| {n:,} | {lion_update * 1e9:.3f} | {costs} | {ratio:.2f} |"


if __name__ == "__main__":
    main()
