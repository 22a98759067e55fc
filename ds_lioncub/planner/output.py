"""What the planner's command line prints: the candidates as a table or JSON, and the ds_config blocks.

:func:`as_table` is the default output of ``python -m ds_lioncub.planner`` (:mod:`ds_lioncub.planner.cli`),
:func:`as_json` its ``--json`` output (the schema is in the command line's docstring), and
:func:`ds_config_blocks` the parts of a ds_config that select a candidate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ds_lioncub.errors import LionCubError
from ds_lioncub.planner.bits import bits_per_element
from ds_lioncub.planner.convergence import MIN_SEEDS, Choice, StudyCell, basis_text
from ds_lioncub.planner.local_costs import DEFAULT_LOCAL_COSTS, LocalCosts
from ds_lioncub.planner.model import Candidate, Cluster, Network, describe_network
from ds_lioncub.quantities.units import format_seconds


def ds_config_blocks(candidate: Candidate) -> dict[str, Any]:
    """The parts of a ds_config that select ``candidate``."""
    blocks: dict[str, Any] = {
        "optimizer": {"type": "LionCub", "params": candidate.params},
        "zero_optimization": {"stage": candidate.zero_stage},
    }
    if candidate.exact and candidate.params.get("comm_dtype") == "bf16":
        # Under DeepSpeed the engine runs exact Lion's all-reduce, in its communication dtype.
        blocks["communication_data_type"] = "bf16"
    clip = candidate.params.get("clip")
    if clip and clip.get("rule", "mean") == "mean":
        blocks["gradient_clipping"] = 0  # option clip's max_norm, written out; DeepSpeed's own clipping is off
    return blocks


def _ratio_fields(choice: Choice, candidate: Candidate) -> dict[str, Any]:
    """r, its interval and basis, and the predicted seconds to exact Lion's loss (step x r, with r's interval)."""
    ratio = choice.ratio_of(candidate)
    step = candidate.seconds_per_step + choice.job.compute_seconds  # the job's forward and backward too, where given
    known = ratio.known
    return {
        "r": ratio.value if known else None,
        "r_low": ratio.low,
        "r_high": ratio.high,
        "r_basis": ratio.basis,
        "seconds_to_lions_loss": step * ratio.value if known else None,
        "seconds_to_lions_loss_low": None if ratio.low is None else step * ratio.low,
        "seconds_to_lions_loss_high": None if ratio.high is None else step * ratio.high,
    }


def as_json(candidates: Sequence[Candidate], choice: Choice, costs: LocalCosts = DEFAULT_LOCAL_COSTS) -> dict[str, Any]:
    best = choice.best
    recommended: dict[str, Any] = {
        "params": best.params,
        "zero_stage": best.zero_stage,
        **_ratio_fields(choice, best),
        "why": choice.ratio_of(best).note,
    }
    if choice.caveat():  # only then, as before: where the study cannot tell the gap within 2%
        recommended["uncertain_loss"] = {**_interval_fields(choice.best_verdict.cell), "why": choice.caveat()}
    verdicts = dict(zip(map(id, choice.candidates), choice.verdicts, strict=True))
    output: dict[str, Any] = {
        "recommended": recommended,
        "local_costs": {"device": costs.device, "measured_on": costs.measured_on},
        "time_to_loss": {
            "global_batch": choice.job.global_batch,
            "noise_scale": choice.job.noise_scale,
            "compute_per_step": choice.job.compute_seconds,
            "basis": basis_text(choice.job),
            "evidence": choice.study,
            "notes": choice.study_notes(),
        },
        "candidates": [
            {
                "params": c.params,
                "zero_stage": c.zero_stage,
                "seconds_per_step": c.seconds_per_step,
                "bytes_per_step_per_rank": c.bytes_per_step_per_rank,
                "bits_per_element": _bits(c, choice),
                **_ratio_fields(choice, c),
                **_interval_fields(verdicts[id(c)].cell),
            }
            for c in candidates
        ],
    }
    if choice.skipped:  # only then: the schema is unchanged wherever nothing faster is passed over
        output["passed_over"] = [
            {
                "params": c.params,
                "zero_stage": c.zero_stage,
                **_interval_fields(verdict.cell),
                **_ratio_fields(choice, c),
                "why": f"later to exact Lion's loss: {choice.time_text(c)} against {choice.time_text(best)}; "
                f"{verdict.note}",
            }
            for c, verdict in choice.skipped
        ]
    return output


def _bits(candidate: Candidate, choice: Choice) -> int | None:
    """The candidate's bits per element (:func:`ds_lioncub.planner.bits.bits_per_element`) at its voters."""
    voters = _voters_of(candidate, choice)
    try:
        return bits_per_element(candidate.params, voters)
    except (ValueError, LionCubError):
        return None


def _voters_of(candidate: Candidate, choice: Choice) -> int:
    return choice.voter_counts[choice.candidates.index(candidate)]


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
    """Every candidate, first to exact Lion's loss first (step time x r), then the recommendation, why the faster
    ones were passed over, and the ds_config blocks to paste."""
    best = choice.best
    width = max([44, *(len(c.label) for c in candidates)])  # option clip's labels are longer
    lines = [
        f"{num_params:,} parameters on {cluster.nodes} x {cluster.gpus_per_node} ranks, {describe_network(network)}",
        describe_local_costs(costs, costs_source),
        basis_text(choice.job),
        *choice.study_notes(),
        "",
        f"{'mode':<{width}} {'ZeRO':>4} {'step':>9} {'comm':>9} {'local':>9} {'bits':>4} {'out of a node':>15} "
        f"{'r [95% interval]':>18} {'to Lion loss':>12}  {'loss vs Lion %':>21}",
    ]

    time_to_loss = choice.seconds_to_loss
    ranked = sorted(candidates, key=lambda c: (time_to_loss(c), c.seconds_per_step))
    for c in ranked:
        verdict = choice.verdicts[choice.candidates.index(c)]
        ratio = choice.ratio_of(c)
        bits = _bits(c, choice)
        loss = format_seconds(time_to_loss(c)) if ratio.known else "?"
        lines.append(
            f"{c.label:<{width}} {c.zero_stage:>4} {format_seconds(c.seconds_per_step):>9} "
            f"{format_seconds(c.comm_seconds):>9} {format_seconds(c.local_seconds):>9} "
            f"{'' if bits is None else bits:>4} {c.node_link_bytes_per_step:>15,} {ratio.text():>18} {loss:>12}  "
            f"{_loss_column(c, verdict.cell):>21}"
        )
    exact = [c for c in candidates if c.exact]
    lines += ["", f"Recommended: {best.label}, predicted {format_seconds(best.seconds_per_step)} per step"]
    if exact and not best.exact:
        later = time_to_loss(exact[0]) / time_to_loss(best)
        lines[-1] += (
            f", {choice.time_text(best)} to exact Lion's loss, against {format_seconds(time_to_loss(exact[0]))} for "
            f"the best exact Lion ({later:.1f}x later)."
        )
        lines.append(f"  r: {choice.ratio_of(best).note}.")
        lines.append(f"  {best_gap(choice)}")
    else:
        lines[-1] += ": compression does not pay here." if not choice.skipped else ", first to exact Lion's loss."
    lines += choice.skipped_lines()
    compute = choice.job.compute_seconds
    lines += [
        (
            f"(step: communication and optimizer; to Lion loss adds the forward and backward, {format_seconds(compute)}"
            " a step (--compute-per-step), which a mode pays r times."
            if compute
            else "(Communication and optimizer only: the forward and backward passes are the same in every mode."
        ),
        " step: comm and local, a compressed mode's votes overlapped with its local work over its buckets.",
        " bits: per gradient element in each rank's message; out of a node: the bytes per step that cross one",
        " node's link to the network. r: the steps the mode needs to reach exact Lion's loss, in units of",
        " exact Lion's; to Lion loss: (step + compute) x r, the ranking ('?': r unknown, ranked by the step alone).",
        " loss vs Lion: the study's validation-loss gap to exact Lion after its steps at the mode's worker",
        " count and beta2, mean [95% Student-t interval] over seeds, judged without momentum sync; '(n)': only",
        f" n seeds (fewer than {MIN_SEEDS}); '-': not studied. It decides nothing alone: r does.)",
        "",
        "ds_config:",
        json.dumps(ds_config_blocks(best), indent=2),
    ]
    return "\n".join(lines)


def best_gap(choice: Choice) -> str:
    """The recommendation's gap after the study's steps, in words ("" for exact Lion)."""
    verdict = choice.best_verdict
    if verdict.cell is None:
        return f"loss vs Lion: {verdict.note}."
    return f"loss vs Lion after the study's steps: {verdict.note.removeprefix('loss vs Lion ')}."


def _loss_column(candidate: Candidate, cell: StudyCell | None) -> str:
    """The study's gap in a table cell: ``+3.3 [+0.3, +6.3]``, ``+1.0(1)`` with one seed, ``-`` when not
    studied."""
    if cell is None:
        return "exact" if candidate.exact else "-"
    interval = "" if cell.low is None or cell.high is None else f" [{cell.low:+.1f}, {cell.high:+.1f}]"
    few = "" if cell.seeds >= MIN_SEEDS else f"({cell.seeds})"
    return f"{cell.gap_percent:+.1f}{interval}{few}"


__all__ = ["as_json", "as_table", "best_gap", "describe_local_costs", "ds_config_blocks"]
