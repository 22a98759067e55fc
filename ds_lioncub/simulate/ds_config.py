"""What ``python -m ds_lioncub.simulate`` takes from a ds_config, decided before any training.

The optimizer block must be ``"type": "LionCub"``; its options are validated as LionCub validates them.
Options that describe the real job rather than the math of a step are decided here, each for its own
reason (:data:`DROPPED_OPTIONS`): dropped with a printed note where the math is the same without them,
refused with the reason where the simulation would not be the job the config describes.

The ZeRO hybrid (a compressed mode under ZeRO stage 1, 2 or 3, with or without a ``"hybrid"`` block):
N ranks run as M nodes of G ranks, and node k is one Lion Cub worker. Inside a node ZeRO averages the
G ranks' gradients in full precision, so a node's gradient is the mean over its G ranks' micro-batches,
which is the gradient of the node's batch (up to fp32 rounding); across nodes the nodes vote. So a
simulated worker is one node with its node's batch, ``--workers`` counts nodes, and ``hybrid`` is
dropped from the virtual world's options. Clipping is decided as the job decides it
(:mod:`ds_lioncub.config.clip_rule`): a compressed mode clips the voters' mean gradient by its sketched norm
(LionCub's option ``clip``, here too), unless the config keeps DeepSpeed's rule, which under bf16/fp16 or the
hybrid clips each worker (node) by its own norm, and otherwise by the mean of the workers' norms. The LionCub
options the real hybrid refuses (``overlap``, ``comm_backend_name="mpi"``, ``momentum_sync`` by layer;
:mod:`ds_lioncub.integration.wiring`) are refused here too, with the same message. DeepSpeed settings the
hybrid also refuses (optimizer or parameter offload, ZenFlow, elastic checkpoints) change no step's
math and are not read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.config.clip_rule import ClipResolution, resolve_clipping
from ds_lioncub.config.rules import hybrid_refusal
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import mode_of
from ds_lioncub.simulate.train import ClipRule

#: Options that do not change a step's math: dropped from the virtual world's options, each with this reason
#: printed before training. ``network`` is not here: it comes only with ``compression="auto"``, which is refused.
DROPPED_OPTIONS: dict[str, str] = {
    # The transports move the same bytes; the virtual world moves them in memory (bit-identical to gloo ranks).
    "comm_backend_name": "which library carries the bytes does not change them; the virtual world moves them in memory",
    "cuda_aware": "how MPI reaches GPU buffers does not change the bytes",
    # docs/options.md, overlap: step() re-packs every bucket and re-votes any that differ, by design.
    "overlap": "votes started during backward give bit-identical results to overlap=False by design",
    # A check that raises when replicas differ; the virtual world keeps one copy of the parameters.
    "consistency_check": "replica checksums check, they do not compute; the virtual world has one copy of the "
    "parameters",
    # Measurement only; the table's match / flip / tie columns are the virtual world's own agreement statistics.
    "telemetry": "per-step measurements do not change the step; the table reports the vote's agreement itself",
}


@dataclass(frozen=True)
class RunSettings:
    """What the ds_config says about a run besides the optimizer's options.

    Fields:
        grad_clip: DeepSpeed's gradient_clipping as the job runs it (0 where LionCub's option clip clips instead, or
            where nothing clips).
        clip_rule: "mean" where LionCub clips (the options then carry clip with its max_norm); with DeepSpeed's rule
            "per_worker" under bf16/fp16 or the ZeRO hybrid, else "deepspeed" (see ds_lioncub.simulate.train).
        clipping: the line that says which clipping runs, as the job logs it.
    """

    grad_clip: float
    clip_rule: ClipRule
    clipping: str


@dataclass(frozen=True)
class SimulationConfig:
    """A ds_config read for the virtual world.

    Fields:
        options: the mode's options for :class:`~ds_lioncub.simulate.VirtualLionCub` (dropped options removed).
        settings: clipping.
        zero_stage: the ds_config's zero_optimization.stage (0 when absent).
        hybrid: whether the config runs the ZeRO hybrid, so that a simulated worker is one node.
        node_size: G from ``hybrid.node_size`` (None: the launcher's, unknown here).
        notes: what was dropped or reinterpreted, and why; printed before training.
    """

    options: dict[str, Any]
    settings: RunSettings
    zero_stage: int
    hybrid: bool
    node_size: int | None
    notes: tuple[str, ...]


def read_ds_config(path: Path) -> SimulationConfig:
    """The LionCub options and run settings of a ds_config.json, every option decided; refuses any other optimizer."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LionCubConfigError(f"LionCub: cannot read the ds_config {path}: {error}. Pass a JSON file.") from None
    block = config.get("optimizer") if isinstance(config, dict) else None
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind.lower() != "lioncub":
        raise LionCubConfigError(
            f'LionCub: {path} has optimizer type {kind!r}; the simulator trains "type": "LionCub" only. '
            f'Set "optimizer": {{"type": "LionCub", "params": {{...}}}} in the ds_config.'
        )
    assert isinstance(block, dict)
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise LionCubConfigError(
            f'LionCub: the optimizer\'s "params" in {path} must be a JSON object of LionCub options, got {params!r}.'
        )
    options = dict(params)
    parsed = parse_config(options)  # LionCub's own validation and messages, before any training
    if mode_of(parsed).chosen_by_planner:
        raise LionCubConfigError(
            "LionCub: the simulator trains a concrete mode, and compression='auto' picks one for a real network; "
            "run python -m ds_lioncub.planner for your cluster and set the compression it recommends in the ds_config."
        )
    stage = zero_stage(config)
    hybrid = not mode_of(parsed).exact and stage > 0
    if parsed.hybrid is not None and stage == 0:  # as the DeepSpeed job refuses it (ds_lioncub.integration.wiring)
        raise LionCubConfigError(
            "LionCub: hybrid applies under ZeRO stage 1, 2 or 3 (shard inside a node, vote across nodes); at stage 0 "
            "every rank is a voter already. Drop hybrid, or set zero_optimization.stage to 1, 2 or 3."
        )
    if hybrid:
        refuse_what_the_hybrid_refuses(parsed, stage)
    notes = [f"{name} dropped: {reason}" for name, reason in DROPPED_OPTIONS.items() if name in options]
    if hybrid:
        notes.append(hybrid_note(parsed, stage))
    mixed = any(_section(config, key).get("enabled", False) for key in ("bf16", "fp16"))
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        notes.append(
            f"the ds_config's scheduler ({scheduler.get('type')}) is not used; the lr follows WarmupCosineLR over "
            f"--steps, peaking at the optimizer's lr"
        )
    resolution = clipping_of(config, parsed, stage)
    settings = RunSettings(
        grad_clip=resolution.engine_clipping,
        clip_rule="mean"
        if resolution.options.mean_clip is not None
        else "per_worker"
        if mixed or hybrid
        else "deepspeed",
        clipping=resolution.description,
    )
    if resolution.options.clip is not None:  # the resolved block: its max_norm may come from gradient_clipping
        options["clip"] = resolution.options.clip.model_dump(include=resolution.options.clip.model_fields_set)
    kept = {name: value for name, value in options.items() if name not in DROPPED_OPTIONS and name != "hybrid"}
    node_size = parsed.hybrid.node_size if parsed.hybrid is not None else None
    return SimulationConfig(kept, settings, stage, hybrid, node_size, tuple(notes))


def clipping_of(config: dict[str, Any], options: LionCubConfig, stage: int) -> ClipResolution:
    """Which clipping the DeepSpeed job of ``config`` runs (DeepSpeed's gradient_clipping defaults to 1.0)."""
    clip = config.get("gradient_clipping", 1.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise LionCubConfigError(
            f"LionCub: the ds_config's gradient_clipping must be a number >= 0 (0 disables clipping), got {clip!r}."
        )
    return resolve_clipping(options, float(clip), "gradient_clipping" in config, stage)


def zero_stage(config: dict[str, Any]) -> int:
    """zero_optimization.stage of a ds_config (0 when absent)."""
    stage = _section(config, "zero_optimization").get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise LionCubConfigError(f"LionCub: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
    return stage


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    section = config.get(key, {})
    if not isinstance(section, dict):
        raise LionCubConfigError(f"LionCub: the ds_config's {key!r} must be a JSON object, got {section!r}.")
    return section


def refuse_what_the_hybrid_refuses(options: LionCubConfig, stage: int) -> None:
    """Refuse the options a DeepSpeed job refuses under the hybrid: a simulation of them would be of no real job."""
    refusals = [
        (options.overlap, "overlap (votes started during backward)", "drop overlap"),
        (
            options.comm_backend_name != "torch",
            f"comm_backend_name={options.comm_backend_name!r} (the MPI world would have to be the vote group)",
            "use comm_backend_name='torch'",
        ),
        (
            options.momentum_sync.interval > 0 and options.momentum_sync.layers != "all",
            "momentum_sync by layer (LionCub steps flat ZeRO shards that mix layers)",
            "use momentum_sync.layers='all'",
        ),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise hybrid_refusal(options, stage, what, fix)


def hybrid_note(options: LionCubConfig, stage: int) -> str:
    """The printed line that says what a simulated worker is under the hybrid."""
    ranks = (
        "its G ranks"
        if options.hybrid is None or options.hybrid.node_size is None
        else (f"its G = {options.hybrid.node_size} ranks")
    )
    note = (
        f"hybrid config (compression={options.compression!r} under ZeRO stage {stage}): the voters are the nodes, "
        f"so each simulated worker is one node ({ranks}' micro-batches, averaged in full precision inside the "
        f"node, are the node's batch) and --workers counts nodes"
    )
    if mode_of(options).scales_by_tensor_mean_abs(options):
        note += (
            "; the L1 scale is the mean |c| of each tensor, which on a real hybrid is a flat ZeRO shard and here "
            "a parameter, so the levels differ in detail"
        )
    return note
