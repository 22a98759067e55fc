"""What examples/compare.py prints after its measured table: the planner's predictions.

On one machine the ranks' "network" is a loopback copy, so compare.py's step times say nothing
about what each configuration costs where communication crosses a real link. The planner
(:mod:`ds_lioncub.planner`, an alpha-beta model of each mode's step) can say what it *would* cost;
:func:`prediction_rows` asks it for every configuration compare.py ran, at 1, 10 and 100 Gbit/s
between nodes: for this model on machines of one CPU rank each (the planner's built-in CPU table and
gloo's link efficiency), and for a 1.3B-parameter model on 4 nodes x 8 H100s (the planner's measured
H100 table and NCCL's link efficiency, as ``--device cuda --gpu H100`` prices them), with the
planner's recommendation for that cluster (:func:`recommendations`). These are predictions, not
measurements, and are printed as such.

The loss plot is :mod:`examples.compare_plot`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the planner is imported where it is used: compare.py imports this module before its jobs start
    from ds_lioncub.planner import Candidate, Cluster, LocalCosts, Network
    from ds_lioncub.planner.convergence import Choice
    from ds_lioncub.planner.devices import Device

LINK_RATES = ("1gbit", "10gbit", "100gbit")
REPORT_WIDTH = 100  # columns of the report's prose (the tables are as wide as they are)
LARGE_MODEL_PARAMS = 1_300_000_000
LARGE_MODEL_NODES = 4
LARGE_MODEL_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class RunConfig:
    """One configuration compare.py ran: its name, label and the LionCub options that shape communication."""

    name: str
    label: str
    params: dict[str, Any]


def communication_params(summary: dict[str, Any]) -> dict[str, Any]:
    """The LionCub options of a run (train_gpt.py's summary) that decide what it sends.

    lr, betas and weight decay do not change the bytes and are left out. With compression "none"
    the gradient all-reduce is DeepSpeed's, in the ds_config's ``communication_data_type``; the
    optimizer's ``comm_dtype`` states that precision in the planner's terms.
    """
    params = {k: v for k, v in summary["optimizer_params"].items() if k not in ("lr", "betas", "weight_decay")}
    if params.get("compression", "1bit") == "none":
        dtype = summary["ds_config"].get("communication_data_type") or params.get("comm_dtype", "fp32")
        params["comm_dtype"] = {"bfp16": "bf16", "fp16": "bf16"}.get(dtype, dtype)
    return params


# ---------------------------------------------------------------------------------------------- predictions

#: The GPU whose local cost table prices the large model's ranks: the planner's default ``--gpu``, which has a
#: table measured on it (:mod:`ds_lioncub.planner.gpu_local_costs`).
LARGE_MODEL_GPU = "H100"
LARGE_MODEL_INTRA_NODE_RATE = "100GB/s"  # NVLink-class links between the GPUs of one node
#: Lion's beta2 in every config in configs/ (and the planner's default ``--beta2``): the convergence study's
#: verdicts depend on it.
BETA2 = 0.99


@dataclass(frozen=True)
class PlannedCluster:
    """A cluster the report asks the planner about, as ``python -m ds_lioncub.planner`` takes it.

    ``device`` and ``gpu`` pick the local cost table and the link efficiencies as the command line's
    ``--device`` and ``--gpu`` do (:func:`ds_lioncub.planner.devices.local_costs_for`,
    :func:`~ds_lioncub.planner.devices.link_efficiency_for`).
    """

    num_params: int
    nodes: int
    gpus_per_node: int
    device: Device = "cpu"
    gpu: str | None = None
    intra_node_rate: str | None = None

    @property
    def shape(self) -> Cluster:
        from ds_lioncub import planner

        return planner.Cluster(nodes=self.nodes, gpus_per_node=self.gpus_per_node)

    def local_costs(self) -> LocalCosts:
        from ds_lioncub.planner.devices import local_costs_for

        return local_costs_for(self.device, gpu=self.gpu)

    def network(self, link_rate: str) -> Network:
        from ds_lioncub import planner
        from ds_lioncub.planner.devices import link_efficiency_for

        intra = None if self.intra_node_rate is None else planner.parse_rate(self.intra_node_rate)
        efficiency = link_efficiency_for(self.device)
        return planner.Network(planner.parse_rate(link_rate), intra, efficiency=efficiency)

    def plan(self, link_rate: str, zero_stage: int | None = None) -> list[Candidate]:
        """The planner's candidates at ``link_rate``: those of ``zero_stage`` alone, or (None) of its default stages."""
        from ds_lioncub import planner

        network, costs = self.network(link_rate), self.local_costs()
        # The configs' gradient_clipping, 1.0, at which a compressed mode clips the mean gradient by its sketch: what
        # the command line plans by default (--clip 1.0).
        clip = {"max_norm": 1.0}
        if zero_stage is None:  # the planner's default stages, as its command line without --zero-stage
            return planner.plan(self.num_params, self.shape, network, costs, clip=clip)
        return planner.plan(self.num_params, self.shape, network, costs, zero_stages=(zero_stage,), clip=clip)

    def planner_command(self, link_rate: str = "RATE", zero_stage: int | None = None) -> str:
        """The ``python -m ds_lioncub.planner`` command that prints the same candidates."""
        words = [
            f"python -m ds_lioncub.planner --params {self.num_params} --nodes {self.nodes}",
            f"--gpus-per-node {self.gpus_per_node} --inter-node-bandwidth {link_rate}",
        ]
        if self.intra_node_rate is not None:
            words.append(f"--intra-node-bandwidth {self.intra_node_rate}")
        words.append(f"--device {self.device}" + ("" if self.gpu is None else f" --gpu {self.gpu}"))
        if zero_stage is not None:
            words.append(f"--zero-stage {zero_stage}")
        return " ".join(words)

    def describe_prices(self) -> str:
        """Which link efficiencies and which local cost table price this cluster's steps, in words."""
        from ds_lioncub.planner import DEFAULT_LOCAL_COSTS
        from ds_lioncub.planner.devices import link_efficiency_for

        efficiency = link_efficiency_for(self.device)
        transport = "NCCL" if self.device == "cuda" else "gloo"
        links = (
            f"{transport}'s link efficiency ({efficiency.ring:g} in rings, {efficiency.all_to_all:g} in all-to-alls)"
        )
        costs = self.local_costs()
        if costs is DEFAULT_LOCAL_COSTS:
            table = f"the planner's built-in CPU table ({costs.measured_on}), one rank per core"
        elif costs.measured_on.startswith("measured: "):
            table = f"the planner's measured {self.gpu} table ({costs.measured_on.removeprefix('measured: ')})"
        else:
            table = f"the planner's {self.gpu} table ({costs.measured_on})"
        return f"{links}; local work: {table}"


@dataclass(frozen=True)
class PredictionRow:
    """The planner's figures for one configuration on one cluster and link rate (``None``: it cannot run there)."""

    config: str
    label: str
    link: str
    bytes_per_step_per_rank: int | None
    comm_s: float | None
    local_s: float | None
    step_s: float | None  # the planner's step: comm_s + local_s, less what the bucket schedule overlaps
    note: str = ""


def why_infeasible(params: dict[str, Any], world_size: int) -> str:
    """Why the planner offers no stage-0 candidate for ``params`` on ``world_size`` ranks."""
    from ds_lioncub.comm.kbit import max_allreduce_world_size
    from ds_lioncub.config import parse_config

    options = parse_config(params)
    if options.compression == "kbit" and options.kbit_algorithm == "allreduce":
        largest = max_allreduce_world_size(options.bits, options.quantizer)
        return f'a {options.bits}-bit {options.quantizer} all-reduce holds at most {largest} ranks ("alltoall": any)'
    return f"no such candidate at {world_size} ranks"


def _key(params: dict[str, Any]) -> str:
    """The planner's aggregation key of LionCub ``params`` (compression, precision or bits, quantizer, algorithm)."""
    from ds_lioncub import planner
    from ds_lioncub.config import parse_config

    return planner.aggregation_key(parse_config(params))


def prediction_rows(
    runs: Sequence[RunConfig], cluster: PlannedCluster, link_rates: Sequence[str] = LINK_RATES
) -> list[PredictionRow]:
    """The planner's stage-0 candidate for each of ``runs`` on ``cluster``, at each link rate.

    Each run's options are matched to the candidate with the same aggregation
    (:func:`ds_lioncub.planner.aggregation_key`); its figures are the planner's own, as
    ``python -m ds_lioncub.planner ... --zero-stage 0`` prints them (:meth:`PlannedCluster.planner_command`).
    """
    from ds_lioncub import planner

    rows = []
    for rate in link_rates:
        by_key = {_key(c.params): c for c in cluster.plan(rate, zero_stage=0)}
        link = planner.format_rate(planner.parse_rate(rate))
        for run in runs:
            found = by_key.get(_key(run.params))
            if found is None:
                note = why_infeasible(run.params, cluster.shape.world_size)
                rows.append(PredictionRow(run.name, run.label, link, None, None, None, None, note))
                continue
            rows.append(
                PredictionRow(
                    run.name,
                    run.label,
                    link,
                    found.bytes_per_step_per_rank,
                    found.comm_seconds,
                    found.local_seconds,
                    found.seconds_per_step,
                )
            )
    return rows


@dataclass(frozen=True)
class Recommendation:
    """The planner's recommendation at one link rate: among the stage-0 candidates, and among all of its default
    stages (0 and 2)."""

    link: str
    stage0: Choice
    default_stages: Choice


def recommendations(cluster: PlannedCluster, link_rates: Sequence[str] = LINK_RATES) -> list[Recommendation]:
    """What ``python -m ds_lioncub.planner`` recommends for ``cluster`` at each link rate, with and without
    ``--zero-stage 0``: the candidate first to exact Lion's loss (step time x r, at :data:`BETA2`, the job's
    noise scale unknown)."""
    from ds_lioncub import planner
    from ds_lioncub.planner.convergence import choose, load_evidence

    evidence = load_evidence()
    return [
        Recommendation(
            planner.format_rate(planner.parse_rate(rate)),
            choose(cluster.plan(rate, zero_stage=0), cluster.shape, BETA2, evidence),
            choose(cluster.plan(rate), cluster.shape, BETA2, evidence),
        )
        for rate in link_rates
    ]


def format_recommendations(found: Sequence[Recommendation], runs: Sequence[RunConfig]) -> list[str]:
    """One line per link rate, then the configurations of ``runs`` the study passed over at stage 0, and why, and
    those recommended at stage 0 whose 95% interval the study cannot clear of 2% (the planner's caveat)."""
    from ds_lioncub import planner

    def pick(choice: Choice) -> str:
        return f"{choice.best.label} ({planner.format_seconds(choice.best.seconds_per_step)})"

    lines = [f"  {r.link:<11} stage 0: {pick(r.stage0)}; stages 0 and 2: {pick(r.default_stages)}" for r in found]
    names = {_key(run.params): run.name for run in runs}
    passed_over: dict[str, str] = {}
    for r in found:
        for candidate, verdict in r.stage0.skipped:
            name = names.get(_key(candidate.params))
            if name is not None:
                passed_over.setdefault(
                    name, f"later to exact Lion's loss ({r.stage0.time_text(candidate)}), {verdict.note}"
                )
    if passed_over:
        reasons = "; ".join(f"{name}, {why}" for name, why in passed_over.items())
        lines.append(_paragraph(f"Passed over at stage 0, though faster per step: {reasons}", "  "))
    uncertain: dict[str, str] = {}
    for r in found:
        name = names.get(_key(r.stage0.best.params))
        if name is not None and r.stage0.caveat():
            uncertain.setdefault(name, r.stage0.best_verdict.note)
    if uncertain:
        reasons = "; ".join(f"{name}, {why}" for name, why in uncertain.items())
        lines.append(
            _paragraph(f"Recommended at stage 0, though the study cannot tell whether within 2%: {reasons}", "  ")
        )
    return lines


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    milliseconds = 1e3 * seconds
    return f"{milliseconds:.2f}" if milliseconds < 100 else f"{milliseconds:,.0f}"


def format_prediction_table(rows: Sequence[PredictionRow], baseline: str) -> str:
    """Plain-text table; *vs Lion* is the ``baseline`` config's predicted step over this row's (above 1: faster)."""
    base = {row.link: row.step_s for row in rows if row.config == baseline}
    header = (
        f"{'config':<18} {'link':<11} {'bytes/step/rank':>16} {'comm ms':>10} {'local ms':>10} "
        f"{'step ms':>10} {'vs Lion':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        reference = base.get(row.link)
        speedup = f"{reference / row.step_s:.1f}x" if reference and row.step_s else "-"
        sent = "-" if row.bytes_per_step_per_rank is None else f"{row.bytes_per_step_per_rank:,}"
        line = (
            f"{row.config:<18} {row.link:<11} {sent:>16} {_ms(row.comm_s):>10} {_ms(row.local_s):>10} "
            f"{_ms(row.step_s):>10} {speedup:>8}"
        )
        lines.append(line + (f"  cannot run: {row.note}" if row.note else ""))
    return "\n".join(lines)


def large_model_cluster() -> PlannedCluster:
    """The large-model block's cluster: a 1.3B-parameter model on 4 nodes x 8 H100s, NVLink-class links inside."""
    return PlannedCluster(
        LARGE_MODEL_PARAMS,
        LARGE_MODEL_NODES,
        LARGE_MODEL_GPUS_PER_NODE,
        device="cuda",
        gpu=LARGE_MODEL_GPU,
        intra_node_rate=LARGE_MODEL_INTRA_NODE_RATE,
    )


def _paragraph(text: str, indent: str = "") -> str:
    """``text`` wrapped to :data:`REPORT_WIDTH` columns, commands and flags kept whole."""
    return textwrap.fill(text, REPORT_WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def _definition(column: str, meaning: str) -> str:
    """``column: meaning``, wrapped under the meaning."""
    label = f"{column}:".ljust(10)
    return _paragraph(label + meaning, " " * len(label))


def prediction_report(runs: Sequence[RunConfig], num_params: int, ranks: int, ranks_device: Device = "cpu") -> str:
    """What compare.py prints after its measured table: the planner's predictions, labelled as such.

    ``ranks_device``: the device the measured runs' ranks used; the small-model block prices CPU ranks either way
    and says so where they were not.
    """
    from ds_lioncub import planner
    from ds_lioncub.planner.convergence import LOSS_THRESHOLD_PERCENT
    from ds_lioncub.planner.model import LIONCUB_BUCKET_SIZE

    baseline = runs[0].name
    latency_us = planner.Network(inter_node_bandwidth=1.0).latency * 1e6  # the default Network latency
    small = PlannedCluster(num_params, ranks, 1)
    large = large_model_cluster()
    like_above = (
        "like the ranks above but each on its own machine"
        if ranks_device == "cpu"
        else f"not the {ranks_device.upper()} ranks above"
    )
    return "\n".join(
        [
            "PLANNER PREDICTIONS (ds_lioncub.planner, an alpha-beta model): NOT measurements.",
            _paragraph(
                "The step times above were measured on one machine, where the ranks' 'network' is a loopback copy: "
                "they show compute and load, not what the bytes would cost on a link. Below, what the planner "
                "predicts each configuration above costs per optimizer step where the ranks talk over a network. "
                "Forward and backward passes are left out (the same in every mode)."
            ),
            _definition(
                "comm ms", f"the collectives: bytes / (link rate x link efficiency) + {latency_us:.0f} us per round"
            ),
            _definition(
                "local ms",
                "Lion's arithmetic and the aggregation's packing and counting, at the per-element costs of the "
                "local cost table each block names",
            ),
            _definition(
                "step ms",
                "the planner's step: comm + local, except that a compressed mode's votes run beside its local "
                f"work over its buckets of {LIONCUB_BUCKET_SIZE:,} elements, so the slower of the two sets the pace",
            ),
            _definition("vs Lion", "Lion's step ms / the row's (above 1: faster)"),
            "",
            _paragraph(
                f"This model ({num_params:,} params: one bucket, step = comm + local) on {ranks} machines of one "
                f"CPU rank each, {like_above}; {small.describe_prices()}:"
            ),
            format_prediction_table(prediction_rows(runs, small), baseline),
            "",
            _paragraph(
                f"A {large.num_params / 1e9:.1f}B-parameter model on {large.nodes} nodes x {large.gpus_per_node} "
                f"GPUs ({large.intra_node_rate} between the GPUs of a node), ZeRO stage 0; {large.describe_prices()}:"
            ),
            format_prediction_table(prediction_rows(runs, large), baseline),
            _paragraph(f"(the rows of: {large.planner_command(zero_stage=0)})", " "),
            _paragraph(
                "The planner's recommendation for that cluster: the fastest mode the convergence study does not show "
                f"losing more than {LOSS_THRESHOLD_PERCENT:g}% of Lion's loss at its voter count and beta2 {BETA2:g}, "
                "among the stage-0 modes and among those of stages 0 and 2 (the command without --zero-stage):"
            ),
            *format_recommendations(recommendations(large), runs),
        ]
    )


__all__ = [
    "BETA2",
    "LARGE_MODEL_GPU",
    "LINK_RATES",
    "PlannedCluster",
    "PredictionRow",
    "Recommendation",
    "RunConfig",
    "communication_params",
    "format_prediction_table",
    "format_recommendations",
    "large_model_cluster",
    "prediction_report",
    "prediction_rows",
    "recommendations",
]
