"""What the planner's command line prints: the candidates as a table or JSON, and the ds_config blocks.

:func:`as_table` is the default output of ``python -m ds_lioncub.planner`` (:mod:`ds_lioncub.planner.cli`),
:func:`as_json` its ``--json`` output (the schema is in the command line's docstring), and
:func:`ds_config_blocks` the parts of a ds_config that select a candidate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ds_lioncub.planner.convergence import LOSS_THRESHOLD_PERCENT, MIN_SEEDS, Choice, StudyCell
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LocalCosts
from ds_lioncub.planner.model import Candidate, Cluster, Network, describe_network
from ds_lioncub.units import format_seconds


def ds_config_blocks(candidate: Candidate) -> dict[str, Any]:
    """The parts of a ds_config that select ``candidate``."""
    blocks: dict[str, Any] = {
        "optimizer": {"type": "LionCub", "params": candidate.params},
        "zero_optimization": {"stage": candidate.zero_stage},
    }
    if candidate.params.get("compression") == "none" and candidate.params.get("comm_dtype") == "bf16":
        # Under DeepSpeed the engine runs exact Lion's all-reduce, in its communication dtype.
        blocks["communication_data_type"] = "bf16"
    clip = candidate.params.get("clip")
    if clip and clip.get("rule", "mean") == "mean":
        blocks["gradient_clipping"] = 0  # option clip's max_norm, written out; DeepSpeed's own clipping is off
    return blocks


def as_json(candidates: Sequence[Candidate], choice: Choice, costs: LocalCosts = DEFAULT_LOCAL_COSTS) -> dict[str, Any]:
    best = choice.best
    recommended: dict[str, Any] = {"params": best.params, "zero_stage": best.zero_stage}
    if choice.caveat():  # only then, as passed_over below: where the study cannot tell its loss
        recommended["uncertain_loss"] = {**_interval_fields(choice.best_verdict.cell), "why": choice.caveat()}
    output: dict[str, Any] = {
        "recommended": recommended,
        "local_costs": {"device": costs.device, "measured_on": costs.measured_on},
        "candidates": [
            {
                "params": c.params,
                "zero_stage": c.zero_stage,
                "seconds_per_step": c.seconds_per_step,
                "bytes_per_step_per_rank": c.bytes_per_step_per_rank,
            }
            for c in candidates
        ],
    }
    if choice.skipped:  # only then: the schema is unchanged wherever the study passes nothing over
        output["passed_over"] = [
            {"params": c.params, "zero_stage": c.zero_stage, **_interval_fields(verdict.cell), "why": verdict.note}
            for c, verdict in choice.skipped
        ]
    return output


def _interval_fields(cell: StudyCell | None) -> dict[str, Any]:
    """The study cell's gap, the half-width of its 95% interval (in points of %) and its seeds, for the JSON
    (None each without a cell)."""
    if cell is None:
        return {"gap_percent": None, "half_width_percent": None, "seeds": None}
    return {"gap_percent": cell.gap_percent, "half_width_percent": cell.half_width_percent, "seeds": cell.seeds}


def describe_local_costs(costs: LocalCosts, source: str | None = None) -> str:
    """Which local cost table priced the local work: the device, where the table came from, and how to change it."""
    device = "CUDA" if costs.device == "cuda" else "CPU"
    if costs is DEFAULT_LOCAL_COSTS:
        return f"local costs: {device} ranks, the built-in table ({costs.measured_on}); GPU ranks: --device cuda"
    where = "" if source is None else f"{source}, "
    return f"local costs: {device} ranks, {where}{costs.measured_on}"


def as_table(
    candidates: Sequence[Candidate],
    num_params: int,
    cluster: Cluster,
    network: Network,
    choice: Choice,
    costs: LocalCosts = DEFAULT_LOCAL_COSTS,
    costs_source: str | None = None,
) -> str:
    best = choice.best
    width = max([44, *(len(c.label) for c in candidates)])  # option clip's labels are longer
    lines = [
        f"{num_params:,} parameters on {cluster.nodes} x {cluster.gpus_per_node} ranks, {describe_network(network)}",
        describe_local_costs(costs, costs_source),
        "",
        f"{'mode':<{width}} {'ZeRO':>4} {'step':>9} {'comm':>9} {'local':>9} {'bytes/step/rank':>16} "
        f"{'out of a node':>15} {'vs best':>8}  {'loss vs Lion %':>21}",
    ]
    for c, verdict in zip(candidates, choice.verdicts, strict=True):
        lines.append(
            f"{c.label:<{width}} {c.zero_stage:>4} {format_seconds(c.seconds_per_step):>9} "
            f"{format_seconds(c.comm_seconds):>9} {format_seconds(c.local_seconds):>9} "
            f"{c.bytes_per_step_per_rank:>16,} {c.node_link_bytes_per_step:>15,} "
            f"{c.seconds_per_step / best.seconds_per_step:>7.2f}x  {_loss_column(c, verdict.cell):>21}"
        )
    exact = [c for c in candidates if c.compression == "none"]
    lines += ["", f"Recommended: {best.label}, predicted {format_seconds(best.seconds_per_step)} per step"]
    if exact and best.compression != "none":
        lines[-1] += (
            f" vs {format_seconds(exact[0].seconds_per_step)} for the best exact Lion "
            f"({exact[0].seconds_per_step / best.seconds_per_step:.1f}x slower)."
        )
    else:
        lines[-1] += ": compression does not pay here." if not choice.skipped else "."
    if choice.caveat():
        lines.append(choice.caveat())
    if choice.skipped:
        lines.append(choice.skipped_sentence())
    lines += [
        "(Communication and optimizer only: the forward and backward passes are the same in every mode.",
        " step: comm and local, a compressed mode's votes overlapped with its local work over its buckets.",
        " bytes/step/rank: all a rank sends; out of a node: what crosses one node's link to the network.",
        " loss vs Lion: the convergence study's validation-loss gap to exact Lion at the mode's worker",
        " count and beta2, mean [95% Student-t interval] over seeds, judged without momentum sync;",
        f" '!': the interval above {LOSS_THRESHOLD_PERCENT:g}% over {MIN_SEEDS}+ seeds, a loss; '(n)': only n seeds,"
        " too few to call a loss; '-': not studied.)",
        "",
        "ds_config:",
        json.dumps(ds_config_blocks(best), indent=2),
    ]
    return "\n".join(lines)


def _loss_column(candidate: Candidate, cell: StudyCell | None) -> str:
    """The study's gap in a table cell: ``+3.3 [+0.3, +6.3]``, ``+5.0 [+2.5, +7.5]!`` when it loses, ``+1.0(1)``
    with one seed, ``-`` when not studied."""
    if cell is None:
        return "exact" if candidate.compression == "none" else "-"
    interval = "" if cell.low is None or cell.high is None else f" [{cell.low:+.1f}, {cell.high:+.1f}]"
    few = "" if cell.seeds >= MIN_SEEDS else f"({cell.seeds})"
    return f"{cell.gap_percent:+.1f}{interval}" + ("!" if cell.loses else few)


__all__ = ["as_json", "as_table", "describe_local_costs", "ds_config_blocks"]
