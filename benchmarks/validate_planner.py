"""The planner's predicted aggregation times against bench_comm's measurements on the emulated network.

    python -m benchmarks.validate_planner --results benchmarks/results/comm_planner_validation

reads every ``*.json`` that ``bench_comm.py --json`` (a list of reports, one per world size) or a
worker's ``--out`` (one report) wrote in that directory, and for each measured op, world size p, link
rate and size n asks :func:`ds_lioncub.planner.predict_aggregation_seconds` what one flat aggregation
of n elements over p ranks should take on that link. The op is mapped to the LionCub options that run
it (:func:`lioncub_params`); the network is the emulated one: every rank its own node behind a
full-duplex link of the measured rate. The emulation adds no delay (its kernel has no netem), but
gloo's rounds over the veths still take tens of microseconds, so the planner's own per-round
latency is kept unless ``--latency`` says otherwise; at n >= 1e7 it is a fraction of a percent.
The local cost table is one rank's alone on a core; the emulated cluster runs its p ranks on one
machine of ``--cores`` cores (2, the machine the checked-in results were measured on), so each
prediction scales it by the ranks per core, ``p * threads / cores`` when above 1. It prints a
markdown table (op, p, bandwidth, n, measured, predicted, ratio, and the same split into
collectives) and writes it beside the results (``--markdown``), then the within-25% counts
separately for the fit subset (p = 2 at 1 Gbit/s, :data:`FIT_SUBSET`) and the held-out rest.

``--fit`` prints the link efficiencies (:class:`ds_lioncub.planner.model.LinkEfficiency`) fitted on
the fit subset alone: the ring's is the median over its ring-only ops (the dense and k-bit
all-reduces) of bytes-at-full-rate time / time in collectives; the all-to-all's the median over the
ops with an all-to-all of its bytes-at-full-rate time / (time in collectives - their all-gather at
the fitted ring efficiency). Only calls that ran as one piece count (the dense ops, and votes
measured with ``@whole`` or small enough for one chunk): a pipelined vote's time inside collectives
is only what its local work left unhidden. The planner's defaults (``GLOO_LINK_EFFICIENCY``) are
these figures; the held-out points then test them.

Its fp32 and bf16 ops all-reduce a tensor already in that dtype, so they are predicted without the
exact mode's local work (the bf16 conversion, which a step pays and the benchmark does not time).
The measured time is bench_comm's ``time_s``: the median over repetitions of the slowest rank's time
for one call, local work (sign extraction, packing, counting) included, as the planner's prediction
is meant to include it. *ratio* is predicted / measured; the target is within 25% (0.75-1.25) for
n >= 1e7, where the link, not per-message latency, should dominate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_comm import OpSpec
from benchmarks.netcluster.units import format_rate

TOLERANCE = 0.25  # |predicted / measured - 1| allowed at n >= TARGET_MIN_N
TARGET_MIN_N = 10**7
FIT_SUBSET = (2, 10**9)  # (p, link bits per second) of the points the link efficiencies are fitted on
MEASURED_CORES = 2  # cores of the machine the checked-in results were measured on


@dataclass(frozen=True)
class Prediction:
    """The planner's seconds for one aggregation: in all, and of the collectives alone (no local work)."""

    total_s: float
    comm_s: float


# predict(params, numel, world_size, link bytes per second, ranks per core, pipeline chunk) -> Prediction
Predictor = Callable[[dict[str, Any], int, int, float, float, int | None], Prediction]


def lioncub_params(op: str) -> dict[str, Any]:
    """The LionCub optimizer options whose aggregation bench_comm's ``op`` times.

    fp32 / bf16 are the exact mode's gradient all-reduce (``compression="none"``, ``comm_dtype``);
    1bit is ``vote_1bit``; ``kbit:<q>:<b>:<algo>`` is ``vote_kbit`` with its default aggregation,
    the vote (bench_comm.make_op calls it without ``aggregation``).
    """
    spec = OpSpec.parse(op)
    if spec.kind in ("fp32", "bf16"):
        return {"compression": "none", "comm_dtype": spec.kind}
    if spec.kind == "1bit":
        return {"compression": "1bit"}
    return {
        "compression": "kbit",
        "bits": spec.bits,
        "quantizer": spec.quantizer,
        "kbit_algorithm": spec.algorithm,
        "aggregation": "vote",
    }


def planner_predictor(latency_s: float | None = None, local_costs_path: Path | None = None) -> Predictor:
    """The planner's predictions on a cluster of one-rank nodes (the emulated one), as a :data:`Predictor`.

    ``latency_s``: the per-round α given to the planner (``None``: its default); ``local_costs_path``: a
    table saved by ``python -m ds_lioncub.planner --calibrate --save`` (``None``: the planner's default).
    The collectives-only figure is the same prediction with a local cost table of zeros.
    """
    from ds_lioncub import planner
    from ds_lioncub.config import parse_config

    costs = None if local_costs_path is None else planner.LocalCosts.load(local_costs_path)

    def predict(
        params: dict[str, Any],
        numel: int,
        world_size: int,
        link_bytes_per_s: float,
        ranks_per_core: float,
        pipeline_chunk_numel: int | None,
    ) -> Prediction:
        network = (
            planner.Network(inter_node_bandwidth=link_bytes_per_s)
            if latency_s is None
            else planner.Network(inter_node_bandwidth=link_bytes_per_s, latency=latency_s)
        )
        no_local_work = planner.LocalCosts({planner.aggregation_key(parse_config(params)): 0.0})
        chunk = pipeline_chunk_numel
        comm_s = planner.predict_aggregation_seconds(params, numel, world_size, network, no_local_work, 1.0, chunk)
        if params["compression"] == "none":
            # bench_comm's fp32 / bf16 ops all-reduce a tensor already in that dtype: no conversion is timed.
            return Prediction(total_s=comm_s, comm_s=comm_s)
        total_s = planner.predict_aggregation_seconds(params, numel, world_size, network, costs, ranks_per_core, chunk)
        return Prediction(total_s=total_s, comm_s=comm_s)

    return predict


@dataclass(frozen=True)
class Row:
    """One measured point and its prediction."""

    op: str
    label: str
    p: int
    rate_bps: int
    n: int
    measured_s: float
    collectives_s: float  # the part of measured_s spent inside collectives (mean over ranks)
    predicted_s: float
    predicted_comm_s: float  # the part of predicted_s that is the collectives' α-β time
    pipelined: bool = False  # ran in more than one pipeline chunk: collectives_s is only the unhidden part

    @property
    def in_fit_subset(self) -> bool:
        return (self.p, self.rate_bps) == FIT_SUBSET

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s

    @property
    def comm_ratio(self) -> float:
        return self.predicted_comm_s / self.collectives_s

    @property
    def in_target(self) -> bool | None:
        """Within TOLERANCE; ``None`` below TARGET_MIN_N (latency-bound sizes are not a target)."""
        if self.n < TARGET_MIN_N:
            return None
        return abs(self.ratio - 1) <= TOLERANCE


def load_reports(results_dir: Path) -> list[dict[str, Any]]:
    """Every bench_comm report in ``results_dir`` (driver files hold a list, worker files one report)."""
    reports: list[dict[str, Any]] = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        for report in data if isinstance(data, list) else [data]:
            if isinstance(report, dict) and "results" in report and "p" in report:
                reports.append(report)
    if not reports:
        raise SystemExit(f"validate_planner: no bench_comm reports (*.json) in {results_dir}")
    return reports


def build_rows(reports: Iterable[dict[str, Any]], predict: Predictor, cores: int = MEASURED_CORES) -> list[Row]:
    """One row per measured point of a shaped link, ordered by rate (fastest first), p, n, then op order.

    ``cores``: of the machine that ran the report's p ranks (each with the report's ``threads``).
    """
    from ds_lioncub.planner.model import vote_chunk_sizes

    rows = []
    for report in reports:
        rate_bps = report.get("rate_bps")
        if not rate_bps:
            continue  # unshaped links: no bandwidth to predict with
        for result in report["results"]:
            n, p = int(result["n"]), int(result["p"])
            ranks_per_core = p * int(report.get("threads") or 1) / cores
            chunk = OpSpec.parse(result["op"]).pipeline_chunk_numel
            params = lioncub_params(result["op"])
            predicted = predict(params, n, p, rate_bps / 8, ranks_per_core, chunk)
            pipelined = params["compression"] != "none" and len(vote_chunk_sizes(n, p, chunk)) > 1
            rows.append(
                Row(
                    op=result["op"],
                    label=result["label"],
                    p=p,
                    rate_bps=int(rate_bps),
                    n=n,
                    measured_s=float(result["time_s"]),
                    collectives_s=float(result["collective_s"]),
                    predicted_s=predicted.total_s,
                    predicted_comm_s=predicted.comm_s,
                    pipelined=pipelined,
                )
            )
    order = {op: i for i, op in enumerate(dict.fromkeys(r.op for r in rows))}
    return sorted(rows, key=lambda r: (-r.rate_bps, r.p, r.n, order[r.op]))


def _seconds(value: float) -> str:
    return f"{value:.4f}" if value < 1 else f"{value:.3f}"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table plus one summary line for the n >= 1e7 target.

    The first columns compare whole calls; the last three split off the collectives (measured: time
    inside them, mean over ranks, waiting for slower ranks included; predicted: the α-β part alone),
    which says whether a miss is in the network model or in the local work. A vote that ran in
    several pipeline chunks spent inside collectives only what its local work left unhidden, so its
    two figures are not compared.
    """
    lines = [
        "| op | p | bandwidth | n | measured (s) | predicted (s) | ratio | within 25% | "
        "in collectives (s) | predicted comm (s) | comm ratio |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        mark = {None: "-", True: "yes", False: "**no**"}[row.in_target]
        comm_ratio = "(pipelined)" if row.pipelined else f"{row.comm_ratio:.2f}"
        lines.append(
            f"| {row.label} | {row.p} | {format_rate(row.rate_bps)} | {row.n:.0e} | {_seconds(row.measured_s)} | "
            f"{_seconds(row.predicted_s)} | {row.ratio:.2f} | {mark} | {_seconds(row.collectives_s)} | "
            f"{_seconds(row.predicted_comm_s)} | {comm_ratio} |"
        )
    judged = [row for row in rows if row.in_target is not None]
    if judged:
        lines.append("")
        lines.append(f"n >= {TARGET_MIN_N:.0e}: {_summary(judged)}")
        fit_p, fit_rate = FIT_SUBSET
        for name, part in (
            (f"fit subset (p = {fit_p}, {format_rate(fit_rate)})", [row for row in judged if row.in_fit_subset]),
            ("held out (the rest)", [row for row in judged if not row.in_fit_subset]),
        ):
            if part:
                lines.append(f"- {name}: {_summary(part)}")
    return "\n".join(lines)


def _summary(rows: Sequence[Row]) -> str:
    """``"M of N points within 25%; median ratio R; furthest: ..."`` over ``rows``."""
    met = sum(1 for row in rows if row.in_target)
    worst = max(rows, key=lambda row: abs(row.ratio - 1))
    median = statistics.median(row.ratio for row in rows)
    return (
        f"{met} of {len(rows)} points within {100 * TOLERANCE:.0f}%, median ratio {median:.2f}; "
        f"furthest: {worst.label}, p = {worst.p}, {format_rate(worst.rate_bps)}, n = {worst.n:.0e}, "
        f"ratio {worst.ratio:.2f}."
    )


def fit_link_efficiency(reports: Iterable[dict[str, Any]]) -> tuple[float, float]:
    """(ring, all-to-all) link efficiencies fitted on the :data:`FIT_SUBSET` points at n >= TARGET_MIN_N.

    See the module docstring; each op's collectives come from the planner, timed at the full link
    rate with no latency, and are set against bench_comm's time inside collectives.
    """
    from ds_lioncub.config import parse_config
    from ds_lioncub.planner import model

    ring_only: list[float] = []
    with_all_to_all: list[tuple[float, float, float]] = []  # (ring s, all-to-all s, in collectives s)
    for report in reports:
        if (report["p"], report.get("rate_bps")) != FIT_SUBSET:
            continue
        network = model.Network(report["rate_bps"] / 8, latency=0.0, efficiency=model.IDEAL_LINK_EFFICIENCY)
        for result in report["results"]:
            n, p = int(result["n"]), int(result["p"])
            if n < TARGET_MIN_N:
                continue
            params = lioncub_params(result["op"])
            if len(model.vote_chunk_sizes(n, p, OpSpec.parse(result["op"]).pipeline_chunk_numel)) > 1 and (
                params["compression"] != "none"
            ):
                continue  # pipelined: its time inside collectives is what the local work did not hide
            seconds = {"ring": 0.0, "all_to_all": 0.0}
            for collective in model.aggregation_collectives(parse_config(params), n, p):
                kind = "all_to_all" if collective.kind == "all_to_all" else "ring"
                seconds[kind] += model.collective_seconds(collective, "spanning", 1, network)
            measured = float(result["collective_s"])
            if seconds["all_to_all"]:
                with_all_to_all.append((seconds["ring"], seconds["all_to_all"], measured))
            else:
                ring_only.append(seconds["ring"] / measured)
    if not ring_only or not with_all_to_all:
        raise SystemExit(
            f"validate_planner: the fit subset {FIT_SUBSET} needs ring-only and all-to-all ops at n >= 1e7"
        )
    ring = statistics.median(ring_only)
    all_to_all = statistics.median(a2a / (measured - ring_s / ring) for ring_s, a2a, measured in with_all_to_all)
    return ring, all_to_all


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="directory of bench_comm JSON reports")
    parser.add_argument(
        "--latency",
        type=float,
        default=None,
        help="seconds per collective round (alpha) given to the planner (default: the planner's own)",
    )
    parser.add_argument(
        "--local-costs",
        type=Path,
        default=None,
        help="local cost table from python -m ds_lioncub.planner --calibrate --save (default: the planner's)",
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the table here (default <results>/planner_vs_measured.md)"
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=MEASURED_CORES,
        help=f"cores of the machine that ran the p ranks (default {MEASURED_CORES}, that of the checked-in results)",
    )
    parser.add_argument(
        "--fit", action="store_true", help="print the link efficiencies fitted on the fit subset (p = 2, 1 Gbit/s)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reports = load_reports(args.results)
    if args.fit:
        ring, all_to_all = fit_link_efficiency(reports)
        subset = f"p = {FIT_SUBSET[0]}, {format_rate(FIT_SUBSET[1])}"
        print(f"fitted on {subset}: ring {ring:.3f}, all-to-all {all_to_all:.3f}")
        return 0
    rows = build_rows(reports, planner_predictor(args.latency, args.local_costs), args.cores)
    text = format_table(rows)
    print(text)
    out = args.markdown if args.markdown is not None else args.results / "planner_vs_measured.md"
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
