"""The planner's ZeRO-3 candidates beside the ZeRO-3 hybrid's netcluster measurements (benchmarks/RESULTS.md).

    python -m benchmarks.planner_vs_zero3 [--intra-node-bandwidth RATE]

reads ``bench_train``'s results in benchmarks/results/train_zero3_hybrid_1gbit and ..._250mbit (4 ranks
as 2 nodes x 2, the 12.9M GPT) and, for exact Lion under ZeRO-3 and the 1-bit ZeRO-3 hybrid, prints a
markdown table of the planner's bytes out of a node per step per rank against the link counters (which
add packet headers), and its step time against the measured one.

The planner leaves out the forward and backward passes' arithmetic (the same in every mode), so the
predicted step adds them as measured where no communication runs inside them: the stage-0 Lion Cub
run's forward and backward (run 1, the same GPT, batches and machine). The cluster is the emulated
one: 2 x 2 at the measured link rate, 4 ranks with one thread on 2 cores (local work x 2, the
planner's ``ranks_per_core``), gloo's link efficiencies, the built-in CPU table. In-node traffic runs
over loopback TCP on the same 2 cores; ``--intra-node-bandwidth`` prices it (default: no bottleneck,
as between GPUs of one machine). Step times are means over steps 4 on of the mean over ranks, as in
the section's tables; bytes the same means of the node link's bytes sent divided by its 2 ranks.

The hybrid is priced as the recorded runs ran it: they predate the gradient noise scale (option
``telemetry.noise_scale``, on by default since), so its sketch all-reduce and local pass are left out
(``"telemetry": {"noise_scale": false}``), and they ran ``gradient_clipping`` 0 (bench_train's ds_config), so
nothing clipped: no clip's sketch either.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ds_lioncub.planner.cluster import Cluster, Network
from ds_lioncub.planner.devices import local_costs_for
from ds_lioncub.planner.local_costs import LocalCosts
from ds_lioncub.planner.model import DEEPSPEED_BUCKET_SIZE, LIONCUB_BUCKET_SIZE, Candidate, plan
from ds_lioncub.planner.zero3 import hybrid_zero3_candidate
from ds_lioncub.quantities.units import format_rate, parse_rate

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = {1e9: "train_zero3_hybrid_1gbit", 250e6: "train_zero3_hybrid_250mbit"}  # link bits/s: results directory
STAGE0_RUN = RUNS[1e9]  # the run with the stage-0 Lion Cub row: its forward and backward are the compute floor
WARMUP = 3  # steps left out of the means (bench_train's report does the same)
CLUSTER = Cluster(nodes=2, gpus_per_node=2)
RANKS_PER_CORE = 2.0  # 4 ranks of one thread on the measuring machine's 2 cores
#: The methods' LionCub options as the recorded runs ran them (module docstring: no noise scale, no clip).
METHODS: dict[str, dict[str, Any]] = {
    "lion_zero3": {"compression": "none"},
    "lioncub_1bit_zero3_hybrid": {"compression": "1bit", "telemetry": {"noise_scale": False}},
}


def load(run: str, method: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((RESULTS / run / f"{method}.json").read_text())
    return result


def mean(result: dict[str, Any], column: str) -> float:
    return statistics.fmean(result["per_step"][column][WARMUP:])


def shared_cores(costs: LocalCosts) -> LocalCosts:
    """``costs`` with every entry RANKS_PER_CORE times as long, as ``plan(..., ranks_per_core=...)`` prices it."""
    scaled = {key: value * RANKS_PER_CORE for key, value in costs.seconds_per_element.items()}
    return replace(costs, seconds_per_element=scaled)


def recorded_candidates(num_params: int, network: Network, costs: LocalCosts) -> dict[str, Candidate]:
    """Each method's candidate as its run ran: exact ZeRO-3 as the planner lists it (no sketch there), the 1-bit
    ZeRO-3 hybrid with METHODS's options (``plan`` lists it with the noise scale, which the runs predate)."""
    exact = next(
        c
        for c in plan(num_params, CLUSTER, network, costs, zero_stages=(3,), ranks_per_core=RANKS_PER_CORE)
        if c.params == METHODS["lion_zero3"]
    )
    hybrid = hybrid_zero3_candidate(
        "1-bit vote",
        METHODS["lioncub_1bit_zero3_hybrid"],
        num_params,
        CLUSTER,
        network,
        shared_cores(costs),
        LIONCUB_BUCKET_SIZE,
        DEEPSPEED_BUCKET_SIZE,
    )
    return {"lion_zero3": exact, "lioncub_1bit_zero3_hybrid": hybrid}


def table(intra_node_bandwidth: float | None) -> str:
    stage0 = load(STAGE0_RUN, "lioncub_1bit")
    compute = mean(stage0, "forward_s") + mean(stage0, "backward_s")
    costs = local_costs_for("cpu", None, None)
    lines = [
        f"forward + backward without communication (stage-0 Lion Cub, {STAGE0_RUN}): {compute * 1e3:.0f} ms",
        "",
        "| link | method | out of a node/step/rank, planner (B) | measured (B) | measured / planner "
        "| planner comm + optimizer (ms) | predicted step (ms) | measured step (ms) | measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    steps: dict[tuple[float, str], tuple[float, float]] = {}
    for rate, run in RUNS.items():
        network = Network(rate / 8, None if intra_node_bandwidth is None else intra_node_bandwidth)
        candidates = recorded_candidates(load(run, "lion_zero3")["n_params"], network, costs)
        for method in METHODS:
            result = load(run, method)
            candidate = candidates[method]
            planned_bytes = candidate.node_link_bytes_per_step / CLUSTER.gpus_per_node
            measured_bytes = mean(result, "tx_bytes")
            predicted, measured = compute + candidate.seconds_per_step, mean(result, "total_s")
            steps[rate, method] = predicted, measured
            lines.append(
                f"| {format_rate(rate / 8)} | {candidate.label} | {planned_bytes:,.0f} | {measured_bytes:,.0f} "
                f"| {measured_bytes / planned_bytes:.4f} | {candidate.seconds_per_step * 1e3:.0f} "
                f"| {predicted * 1e3:.0f} | {measured * 1e3:.0f} | {measured / predicted:.2f} |"
            )
    lines.append("")
    for rate in RUNS:
        (exact_p, exact_m), (hybrid_p, hybrid_m) = (steps[rate, method] for method in METHODS)
        lines.append(
            f"{format_rate(rate / 8)}: hybrid vs exact ZeRO-3, predicted {exact_p / hybrid_p:.2f}x faster, "
            f"measured {exact_m / hybrid_m:.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--intra-node-bandwidth",
        type=parse_rate,
        metavar="RATE",
        help="the in-node links' rate (default: no bottleneck), e.g. 1gbit",
    )
    args = parser.parse_args(argv)
    print(table(args.intra_node_bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
