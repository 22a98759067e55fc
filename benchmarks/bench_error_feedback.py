"""Error feedback's local cost: one k-bit L1 all-to-all aggregation of a bucket with and without it.

    python -m benchmarks.bench_error_feedback [--numel 8388608] [--repeats 7]

Each aggregation runs its real code (``build_aggregation``) as rank 0 of 4 ranks over the planner's
loopback transport (collectives move nothing between ranks: what is timed is the rank's own work, as
``python -m ds_lioncub.planner --calibrate`` times it), on one bucket of ``--numel`` fp32 elements, one
torch thread; the median of ``--repeats`` runs after a warm-up, in ns per element and in units of Lion's
own update (direction, momentum, update: the planner table's ``lion_update``). The difference with and
without feedback, in those units, is what the planner adds (``ERROR_FEEDBACK_LOCAL_PASSES``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.timing import lion_update_unit, median_seconds
from ds_lioncub.aggregation import Aggregator, Bucket, build_aggregation
from ds_lioncub.config import parse_config
from ds_lioncub.planner.calibrate import LoopbackTransport


def aggregate(aggregator: Aggregator, bucket: Bucket, out: torch.Tensor) -> Callable[[], object]:
    """One aggregation of ``bucket`` (start reads the values: they stay the same input every run)."""
    return lambda: aggregator.finish(aggregator.start(bucket, True), out=out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n = args.numel
    lion, values, grad = lion_update_unit(n)

    lion_update = median_seconds(lion, args.repeats) / n
    print(f"lion_update: {lion_update * 1e9:.2f} ns/element")
    print("| bits | error feedback | ns/element | in lion_update | added by EF, in lion_update |")
    print("|---|---|---|---|---|")
    out = torch.empty(n)
    for bits in (2, 4):
        plain = 0.0
        for kind in (None, "residual", "ef21"):
            options = {"compression": "kbit", "bits": bits, "quantizer": "l1", "kbit_algorithm": "alltoall"}
            if kind is not None:
                options["error_feedback"] = {"kind": kind}
            aggregator = build_aggregation(parse_config(options), LoopbackTransport(4, 0), False)
            assert aggregator is not None
            cost = median_seconds(aggregate(aggregator, Bucket(values, [n], [None], key=(0, 0)), out), args.repeats) / n
            plain = cost if kind is None else plain
            added = "" if kind is None else f"{(cost - plain) / lion_update:.2f}"
            print(f"| {bits} | {kind or 'none'} | {cost * 1e9:.2f} | {cost / lion_update:.2f} | {added} |")


if __name__ == "__main__":
    main()
