"""``compression="auto"``: the planner's choice for this model, world and network, as concrete options.

:func:`resolve_auto` is a pure function of values every rank shares (the options, the number of
parameters, the world and node sizes, the ZeRO stage, the built-in local cost table), so every rank
resolves the same mode without communicating; the set-up fingerprint (docs/design.md, section 13)
then compares the resolved options across ranks. It is called where the world is known: by
:class:`~ds_lioncub.optimizer.LionCub` at construction (ZeRO stage 0), and by the DeepSpeed wiring
before it builds LionCub from a ds_config (the engine's ZeRO stage, bucket size and gradient
communication dtype).

The result is the candidate of :func:`~ds_lioncub.planner.plan` at that ZeRO stage that reaches exact Lion's
loss first, as the planner ranks them (:func:`ds_lioncub.planner.convergence.choose`): step time x r, the steps
the mode needs in units of exact Lion's at the voters' count and ``betas[1]``, at the job's global batch over its
noise scale where option ``job`` gives them (the planner's ``--global-batch`` and ``--noise-scale``), else its
worst case, 1/kappa; the sentence says which. ``job.compute_per_step`` is added to every mode's step, as the
planner's ``--compute-per-step``. Passing over a faster mode (it reaches the loss later) is
said in the sentence, with each mode's step x r, and logged as a warning; the chosen mode's gap after the
study's steps is in the sentence too. Under
ZeRO stage 3 the candidates are exact Lion under ZeRO-3 and the ZeRO-3 hybrid
(:mod:`ds_lioncub.planner.zero3`). The options the user gave are kept, except that ``network`` and
``job`` are dropped (they served their purpose), and when exact Lion wins ``momentum_sync`` and ``hybrid`` too
(they apply to compressed modes only), and ``telemetry.vote_stats`` is turned off (exact Lion takes no vote
to measure; the sentence says so); at stage 0 ``hybrid`` only gives the node size. One sentence says
what was chosen and why; the caller logs it on rank 0, at warning level when compression was found not
to pay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.topology import NODE_SIZE_VARIABLES, plan_hybrid, resolve_node_size
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.modes import mode_named, mode_of
from ds_lioncub.planner.convergence import choose
from ds_lioncub.planner.devices import DEFAULT_GPU, Device, format_bandwidth, link_efficiency_for, local_costs_for
from ds_lioncub.planner.local_costs import LocalCosts
from ds_lioncub.planner.model import (
    Candidate,
    Cluster,
    LinkEfficiency,
    Network,
    describe_network,
    plan,
)
from ds_lioncub.planner.output import best_gap
from ds_lioncub.planner.time_to_loss import JobBatch
from ds_lioncub.quantities.units import format_seconds

COMPRESSED_ONLY = ("momentum_sync", "hybrid")
#: How set-up errors name G, the ranks per node that ``"auto"`` plans for.
AUTO_NODE_SIZE_LABEL = "the ranks per node compression='auto' plans for"


@dataclass(frozen=True)
class AutoResolution:
    """What ``compression="auto"`` became.

    Attributes:
        options: the concrete options (compression "none", "1bit" or "kbit").
        sentence: what was chosen and why, for the log.
        fell_back: True when the choice is a fallback, logged as a warning: exact Lion because compression
            does not pay, or a slower mode because the convergence study shows a faster one losing Lion's loss.
        candidates: the planner's candidates, fastest first (empty when there was nothing to plan).
    """

    options: LionCubConfig
    sentence: str
    fell_back: bool
    candidates: tuple[Candidate, ...] = ()


def _concrete(options: LionCubConfig, chosen: dict[str, Any], zero_stage: int) -> LionCubConfig:
    """The user's options with the chosen mode in place of "auto"."""
    given = options.model_dump(include=options.model_fields_set)
    given.pop("network", None)
    given.pop("job", None)  # like network: what auto planned with, which no concrete mode takes
    exact = mode_named(chosen["compression"]).exact
    if exact or zero_stage == 0:
        given.pop("hybrid", None)
    if exact:
        given.pop("momentum_sync", None)
        given.pop("overlap", None)  # a vote to start during backward: exact Lion takes none
        if "telemetry" in given:
            given["telemetry"] = {**given["telemetry"], "vote_stats": False}
    mode = dict(chosen)
    if "hybrid" in given:
        mode.pop("hybrid", None)  # the user's own block (it gave the node size)
    return parse_config({**given, **mode})


def _vote_stats_note(options: LionCubConfig) -> str:
    """What the sentence adds when exact Lion is chosen for options that asked for vote statistics."""
    if not options.telemetry.vote_stats:
        return ""
    return " telemetry.vote_stats is turned off: exact Lion takes no vote to measure."


def _exact(options: LionCubConfig, sentence: str) -> AutoResolution:
    resolved = _concrete(options, {"compression": "none"}, 0)
    return AutoResolution(resolved, sentence + _vote_stats_note(options), fell_back=True)


def resolve_auto(
    options: LionCubConfig,
    num_params: int,
    world_size: int,
    node_size: int,
    zero_stage: int = 0,
    *,
    exact_comm_dtypes: Sequence[str] = ("fp32", "bf16"),
    exact_bucket_size: int | None = None,
    local_costs: LocalCosts | None = None,
    device: Device = "cpu",
    default_clip: float = 0.0,
) -> AutoResolution:
    """The concrete options for ``options`` with ``compression="auto"`` (others are returned as they are).

    ``world_size`` ranks in nodes of ``node_size`` (which must divide it) train ``num_params``
    parameters at ZeRO ``zero_stage``. ``exact_comm_dtypes`` and ``exact_bucket_size``: how exact Lion's
    gradients would travel (LionCub's own all-reduce by default: either dtype, in ``bucket_size``
    buckets; under DeepSpeed the engine's dtype and buckets). ``device``: where the ranks' local work runs
    ("cpu" or "cuda"): it picks the local cost table (the built-in CPU table, or the H100's measured table,
    scaled to ``network.device_bandwidth`` where that is set; ``local_costs`` overrides either) and the link
    efficiencies left unset (gloo's, or NCCL's). ``default_clip``: the max_norm a compressed mode clips the mean
    gradient at when the options do not set clip (DeepSpeed's gradient_clipping under the engine; 0 in Python).
    """
    if not mode_of(options).chosen_by_planner:
        return AutoResolution(options, "", fell_back=False)
    assert options.network is not None  # the config's validation requires it with "auto"
    given = options.network
    default = link_efficiency_for(device)
    efficiency = LinkEfficiency(
        default.ring if given.ring_efficiency is None else given.ring_efficiency,
        default.all_to_all if given.all_to_all_efficiency is None else given.all_to_all_efficiency,
    )
    if local_costs is None and device == "cuda":
        local_costs = local_costs_for("cuda", given.device_bandwidth)
    network = Network(given.bandwidth, given.intra_node_bandwidth, given.latency, efficiency)
    if world_size == 1:
        return _exact(options, "LionCub auto: exact Lion (compression 'none'): a world of one rank sends nothing.")
    layout = plan_hybrid(world_size, node_size)
    where = f"{num_params:,} parameters on {layout.nodes} x {layout.node_size} ranks at {describe_network(network)}"
    if device == "cuda":  # the CPU sentence stays as it was; a CUDA one says which table priced the local work
        if given.device_bandwidth is None:
            where += f", CUDA ranks (local work as measured on an {DEFAULT_GPU})"
        else:
            bandwidth = format_bandwidth(given.device_bandwidth)
            where += (
                f", CUDA ranks (local work as measured on an {DEFAULT_GPU}, scaled to {bandwidth} memory bandwidth)"
            )
    if zero_stage in (1, 2, 3) and layout.nodes == 1:
        return _exact(
            options,
            f"LionCub auto: exact Lion (compression 'none'): under ZeRO stage {zero_stage} LionCub votes across "
            f"nodes, and all {world_size} ranks are on one node.",
        )
    candidates = plan(
        num_params,
        Cluster(layout.nodes, layout.node_size),
        network,
        local_costs,
        zero_stages=(0,) if zero_stage == 0 else (2,) if zero_stage in (1, 2) else (3,),
        exact_comm_dtypes=exact_comm_dtypes,
        bucket_size=options.bucket_size,
        exact_bucket_size=options.bucket_size if exact_bucket_size is None else exact_bucket_size,
        hybrid_with_one_rank_per_node=zero_stage != 0,
        clip=_planned_clip(options, default_clip),
    )
    # The mode first to exact Lion's loss at these voters and beta2: (step + compute) x r, r at the job's batch over
    # its noise scale where option job gives them, else its worst case.
    sync = options.momentum_sync.model_dump() if options.momentum_sync.interval else None
    job = JobBatch()
    if options.job is not None:
        job = JobBatch(options.job.global_batch, options.job.noise_scale, options.job.compute_per_step)
    choice = choose(candidates, Cluster(layout.nodes, layout.node_size), options.betas[1], momentum_sync=sync, job=job)
    best = choice.best
    skipped = f" {choice.skipped_sentence()}" if choice.skipped else ""
    exact = next(c for c in candidates if c.exact)
    compressed = next(c for c in candidates if not c.exact)
    if best.exact and choice.skipped:
        sentence = (
            f"LionCub auto: compression would pay per step for {where} ({compressed.label} predicted at "
            f"{format_seconds(compressed.seconds_per_step)}/step, exact Lion at "
            f"{format_seconds(exact.seconds_per_step)}), but no faster mode reaches exact Lion's loss sooner; using "
            f"exact Lion (compression 'none', {exact.label})." + skipped + _vote_stats_note(options)
        )
        return AutoResolution(_concrete(options, best.params, zero_stage), sentence, True, tuple(candidates))
    if best.exact:
        sentence = (
            f"LionCub auto: compression does not pay for {where}: the best compressed mode ({compressed.label}) is "
            f"predicted at {format_seconds(compressed.seconds_per_step)}/step, exact Lion at "
            f"{format_seconds(exact.seconds_per_step)}; using exact Lion (compression 'none', {exact.label})."
            + skipped
            + _vote_stats_note(options)
        )
        return AutoResolution(_concrete(options, best.params, zero_stage), sentence, True, tuple(candidates))
    ratio = choice.ratio_of(best)
    notes = "".join(f" {note}" for note in choice.study_notes())
    sentence = (
        f"LionCub auto: {best.label}, predicted {format_seconds(best.seconds_per_step)}/step vs "
        f"{format_seconds(exact.seconds_per_step)} for exact Lion, for {where}; to exact Lion's loss "
        f"{choice.time_text(best)} (r: {ratio.note}; {best_gap(choice).rstrip('.')}).{notes}{skipped}"
    )
    return AutoResolution(_concrete(options, best.params, zero_stage), sentence, bool(skipped), tuple(candidates))


def _planned_clip(options: LionCubConfig, default_clip: float) -> dict[str, Any] | None:
    """Option clip's block as the compressed candidates will run it (:mod:`ds_lioncub.config.clip_rule`): the given
    mean rule, DeepSpeed's rule, or, when the options say nothing, the mean rule at ``default_clip`` (DeepSpeed's
    gradient_clipping under the engine; 0, no clipping, for LionCub built in Python)."""
    clip = options.clip
    if clip is not None and clip.rule == "deepspeed":
        return {"rule": "deepspeed"}
    mean = options.mean_clip
    if mean is not None:
        return {"max_norm": mean.max_norm, "sketch_bins": mean.sketch_bins}
    if clip is None and default_clip > 0:
        return {"max_norm": default_clip}
    return None


def auto_node_size(options: LionCubConfig, environ: Mapping[str, str]) -> int:
    """G for planning: ``hybrid.node_size``, else the launcher's ranks per machine, else 1 (one rank per node)."""
    option = options.hybrid.node_size if options.hybrid is not None else None
    if option is None and not any(environ.get(name, "").strip() for name in NODE_SIZE_VARIABLES):
        return 1
    return resolve_node_size(option, environ)[0]


def log_auto_resolution(resolution: AutoResolution, rank: int) -> None:
    """The resolution's sentence on rank 0: a warning when compression was found not to pay, else info."""
    if rank != 0 or not resolution.sentence:
        return
    if resolution.fell_back:
        get_logger().warning(resolution.sentence)
    else:
        get_logger().info(resolution.sentence)


__all__ = ["AUTO_NODE_SIZE_LABEL", "AutoResolution", "auto_node_size", "log_auto_resolution", "resolve_auto"]
