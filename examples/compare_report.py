"""What examples/compare.py adds after its measured table: the planner's predictions and a loss plot.

On one machine the ranks' "network" is a loopback copy, so compare.py's step times say nothing
about what each configuration costs where communication crosses a real link. The planner
(:mod:`ds_lioncub.planner`, an alpha-beta model of each mode's step) can say what it *would* cost;
:func:`prediction_rows` asks it for every configuration compare.py ran, for this model on a cluster
of one-GPU nodes and for a 1.3B-parameter model on 4 nodes x 8 GPUs, at 1, 10 and 100 Gbit/s
between nodes. These are predictions, not measurements, and are printed as such.

:func:`write_loss_plot` draws each run's per-step training loss (rank 0's, as train_gpt.py records it
in ``train_loss_rank0``) into one PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINK_RATES = ("1gbit", "10gbit", "100gbit")
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


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1) : index + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def write_loss_plot(runs: Sequence[tuple[str, list[float]]], path: Path, title: str, smoothing: int = 10) -> Path:
    """One curve per (label, per-step losses) into a PNG at ``path``; returns ``path``.

    Top: the losses as recorded. The runs share seed, data and model, so their curves lie on top of
    each other; the bottom panel shows each later run's loss minus the first run's (the baseline),
    as a trailing mean over ``smoothing`` steps, where the differences can be seen.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (losses_axes, difference_axes) = plt.subplots(
        2, 1, figsize=(8, 7), dpi=110, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    # Runs can train identically (with 2 ranks the 1-bit and 4-bit sign votes are the same vote):
    # distinct dash patterns keep a curve drawn under another visible.
    styles = ["-", "--", "-.", ":"]
    baseline_label, baseline = runs[0]
    for index, (label, losses) in enumerate(runs):
        style, colour = styles[index % len(styles)], f"C{index}"
        steps = range(1, len(losses) + 1)
        losses_axes.plot(steps, losses, style, color=colour, label=label, linewidth=1.2)
        if index > 0:
            difference = [mine - base for mine, base in zip(losses, baseline, strict=False)]
            difference_axes.plot(
                steps[: len(difference)], trailing_mean(difference, smoothing), style, color=colour, linewidth=1.2
            )
    losses_axes.set_ylabel("train loss (rank 0, one batch)")
    losses_axes.set_title(title, fontsize=10)
    losses_axes.legend(fontsize=8)
    difference_axes.axhline(0.0, color="0.5", linewidth=0.8)
    difference_axes.set_ylabel(f"minus {baseline_label.split(':')[0]}\n(trailing mean, {smoothing} steps)", fontsize=8)
    difference_axes.set_xlabel("optimizer step")
    for axes in (losses_axes, difference_axes):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


# ---------------------------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class PredictionRow:
    """The planner's figures for one configuration on one cluster and link rate (``None``: it cannot run there)."""

    config: str
    label: str
    link: str
    bytes_per_step_per_rank: int | None
    comm_s: float | None
    local_s: float | None
    step_s: float | None  # comm_s + local_s; comm_s alone where local work is not predicted
    note: str = ""


def cluster_network(link_rate: str, intra_node_rate: str | None) -> Any:
    """The planner's Network: ``link_rate`` between nodes, ``intra_node_rate`` inside one, default latency."""
    from ds_lioncub import planner

    intra = None if intra_node_rate is None else planner.parse_rate(intra_node_rate)
    return planner.Network(inter_node_bandwidth=planner.parse_rate(link_rate), intra_node_bandwidth=intra)


def why_infeasible(params: dict[str, Any], world_size: int) -> str:
    """Why the planner offers no stage-0 candidate for ``params`` on ``world_size`` ranks."""
    from ds_lioncub.comm.kbit import max_allreduce_world_size
    from ds_lioncub.config import parse_config

    options = parse_config(params)
    if options.compression == "kbit" and options.kbit_algorithm == "allreduce":
        largest = max_allreduce_world_size(options.bits, options.quantizer)
        return f'a {options.bits}-bit {options.quantizer} all-reduce holds at most {largest} ranks ("alltoall": any)'
    return f"no such candidate at {world_size} ranks"


def prediction_rows(
    runs: Sequence[RunConfig],
    num_params: int,
    nodes: int,
    gpus_per_node: int,
    link_rates: Sequence[str] = LINK_RATES,
    intra_node_rate: str | None = None,
    local_work: bool = True,
) -> list[PredictionRow]:
    """The planner's stage-0 step for each of ``runs`` on ``nodes`` x ``gpus_per_node``, at each link rate.

    Each run's options are matched to the planner's candidate with the same aggregation
    (:func:`ds_lioncub.planner.aggregation_key`: compression, precision or bits, quantizer, algorithm).
    ``local_work=False``: the collectives alone (a local cost table of zeros; ``local_s`` is ``None``),
    for hardware the planner's default table, measured on a CPU, does not describe.
    """
    from ds_lioncub import planner
    from ds_lioncub.config import parse_config

    cluster = planner.Cluster(nodes=nodes, gpus_per_node=gpus_per_node)
    costs = (
        None if local_work else planner.LocalCosts(dict.fromkeys(planner.DEFAULT_LOCAL_COSTS.seconds_per_element, 0.0))
    )
    rows = []
    for rate in link_rates:
        network = cluster_network(rate, intra_node_rate)
        candidates = planner.plan(num_params, cluster, network, costs, zero_stages=(0,))
        by_key = {planner.aggregation_key(parse_config(c.params)): c for c in candidates if c.zero_stage == 0}
        link = planner.format_rate(planner.parse_rate(rate))
        for run in runs:
            found = by_key.get(planner.aggregation_key(parse_config(run.params)))
            if found is None:
                note = why_infeasible(run.params, cluster.world_size)
                rows.append(PredictionRow(run.name, run.label, link, None, None, None, None, note))
                continue
            rows.append(
                PredictionRow(
                    run.name,
                    run.label,
                    link,
                    found.bytes_per_step_per_rank,
                    found.comm_seconds,
                    found.local_seconds if local_work else None,
                    found.seconds_per_step,
                )
            )
    return rows


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


def prediction_report(runs: Sequence[RunConfig], num_params: int, ranks: int) -> str:
    """What compare.py prints after its measured table: the planner's predictions, labelled as such."""
    from ds_lioncub import planner

    baseline = runs[0].name
    large_intra = "100GB/s"  # NVLink-class links between the GPUs of one node
    latency_us = planner.Network(inter_node_bandwidth=1.0).latency * 1e6  # the default Network latency
    large = (LARGE_MODEL_PARAMS, LARGE_MODEL_NODES, LARGE_MODEL_GPUS_PER_NODE)
    large_rows = prediction_rows(runs, *large, intra_node_rate=large_intra, local_work=False)
    return "\n".join(
        [
            "PLANNER PREDICTIONS (ds_lioncub.planner, an alpha-beta model): NOT measurements.",
            "The step times above were measured on one machine, where the ranks' 'network' is a loopback",
            "copy: they show compute and load, not what the bytes would cost on a link. Below, what the",
            "planner predicts each configuration above costs per optimizer step where the ranks talk over a",
            f"network. comm ms: the collectives (bytes / link rate + {latency_us:.0f} us per round); local ms:",
            "Lion's arithmetic and the aggregation's packing and counting at the planner's default",
            "per-element costs, measured on a CPU; step ms: comm + local. Forward and backward passes are",
            "left out (the same in every mode). vs Lion: Lion's step ms / the row's (above 1: faster).",
            "",
            f"This model ({num_params:,} params) on {ranks} machines of one CPU rank each, like the ranks above",
            "but each on its own machine:",
            format_prediction_table(prediction_rows(runs, num_params, ranks, 1), baseline),
            "",
            f"A {large[0] / 1e9:.1f}B-parameter model on {large[1]} nodes x {large[2]} GPUs ({large_intra} between "
            f"the GPUs of a node), ZeRO stage 0,",
            "communication only (the planner's local costs are CPU figures, which do not describe GPUs):",
            format_prediction_table(large_rows, baseline),
            "(python -m ds_lioncub.planner --params N --nodes M --gpus-per-node G --inter-node-bandwidth RATE",
            " ranks every mode, the ZeRO-2 hybrid included, for any cluster.)",
        ]
    )
