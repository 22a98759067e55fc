"""Which clipping runs (option ``clip`` against DeepSpeed's ``gradient_clipping``, decided once, before training),
and what a step's sketch carries (the clip's bins, the noise scale's squared norm).

Why: exact training clips the norm of the ranks' *mean* gradient. Under compression every rank keeps its own
gradient, and DeepSpeed's ``clip_grad_norm_`` then averages the ranks' *own* norms, several times the norm of
their mean, so it clips harder every step (benchmarks/RESULTS.md, "Where the gap comes from": +8.2% of loss for the
1-bit vote at 64 voters against +3.2% with the mean's norm). DeepSpeed's ``gradient_clipping`` defaults to 1.0, so
every job clips unless it says 0. So a compressed mode clips the mean by its sketched norm
(:mod:`ds_lioncub.step.clipping`) at ``gradient_clipping``, and DeepSpeed's own clipping is switched off for that
engine: nothing clips twice.

The cases (:func:`resolve_clipping`; ``written``: the ds_config names ``gradient_clipping``):

- ``compression="none"``: DeepSpeed averages the gradients first, so its clipping is already the mean's. It keeps
  clipping, unless the config asks for option ``clip`` at stage 0 (then LionCub clips, as before 0.2.0).
- a compressed mode, ``clip`` not given: rule ``"mean"`` at ``gradient_clipping`` (nothing clips when it is 0).
- ``{"rule": "deepspeed"}``: DeepSpeed's own rule, as before 0.2.0 (to reproduce an older run).
- rule ``"mean"`` with a ``max_norm``: at that norm; a written ``gradient_clipping`` of another value above 0 is a
  second, different request and is refused; a defaulted one gives way.
- rule ``"mean"`` without a ``max_norm``: at ``gradient_clipping``; refused when that is 0 (no norm to clip to).

Every rank reads the same config, so every rank decides the same and raises the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_lioncub.config.options import LionCubConfig
from ds_lioncub.config.sections import ClipConfig
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import mode_of

#: How to keep DeepSpeed's rule, as a config writes it (in messages and the log line).
DEEPSPEED_RULE_JSON = '"clip": {"rule": "deepspeed"}'


@dataclass(frozen=True)
class ClipResolution:
    """What clips in one job.

    Fields:
        options: LionCub's options with ``clip`` resolved: rule ``"mean"`` with a ``max_norm`` when LionCub clips
            (:attr:`LionCubConfig.mean_clip` is then set), else as given.
        engine_clipping: what DeepSpeed's ``gradient_clipping`` must be for this engine (0 when LionCub clips).
        description: the one line rank 0 logs: which clipping runs, and how to choose the other.
    """

    options: LionCubConfig
    engine_clipping: float
    description: str


def resolve_clipping(options: LionCubConfig, gradient_clipping: float, written: bool, stage: int) -> ClipResolution:
    """Decide which clipping runs (module docstring) from LionCub's options and DeepSpeed's ``gradient_clipping``.

    ``written``: whether the ds_config names ``gradient_clipping`` (a defaulted 1.0 gives way to option ``clip``);
    ``stage``: the ZeRO stage. Idempotent: resolving the result again gives the same result.
    """
    clip = options.clip
    compressed = not mode_of(options).exact
    if clip is not None and clip.rule == "deepspeed":
        return ClipResolution(options, gradient_clipping, _deepspeed_rule_line(options, gradient_clipping))
    if clip is None and not compressed:
        return ClipResolution(options, gradient_clipping, _deepspeed_rule_line(options, gradient_clipping))
    if clip is not None and not compressed and stage in (1, 2, 3):
        raise LionCubConfigError(
            f"LionCub: option clip under ZeRO stage {stage} needs a compressed mode (the hybrid). With compression "
            f"'none' ZeRO averages the gradients before LionCub's step, and DeepSpeed's gradient_clipping clips their "
            f"mean exactly: drop clip and set gradient_clipping to the norm you want."
        )
    max_norm = _max_norm(clip, gradient_clipping, written)
    if max_norm is None:
        line = "LionCub: no gradient clipping (the ds_config's gradient_clipping is 0)."
        return ClipResolution(options, 0.0, line)
    bins = ClipConfig.model_fields["sketch_bins"].default if clip is None else clip.sketch_bins
    resolved = ClipConfig(rule="mean", max_norm=max_norm, sketch_bins=bins)
    source = "clip.max_norm" if clip is not None and clip.max_norm is not None else "gradient_clipping"
    line = (
        f"LionCub: clipping the ranks' mean gradient at max_norm {max_norm:g} (from {source}) by its norm, estimated "
        f"from a {bins}-bin sketch, as exact training clips; DeepSpeed's gradient_clipping is off for this engine. "
        f"{DEEPSPEED_RULE_JSON} keeps DeepSpeed's rule (each rank clipped by the mean of the ranks' own norms)."
    )
    return ClipResolution(options.model_copy(update={"clip": resolved}), 0.0, line)


#: The sketch's bins when option ``clip`` is not given: its default (a prime; the relative error of ``|G_B|^2`` is
#: about ``sqrt(2 / K)``, 2% a step, far below the step-to-step noise of the estimates themselves).
DEFAULT_SKETCH_BINS: int = ClipConfig.model_fields["sketch_bins"].default


def sketch_bins_of(options: LionCubConfig) -> int:
    """The bins of the step's sketch: option ``clip``'s when given (one sketch serves the clip and the noise
    scale), else :data:`DEFAULT_SKETCH_BINS`."""
    return DEFAULT_SKETCH_BINS if options.clip is None else int(options.clip.sketch_bins)


def measures_noise_scale(options: LionCubConfig, voters: int, gradients_averaged: bool) -> bool:
    """Whether the noise scale is measured: option ``telemetry.noise_scale``, a mode that votes (with compression
    ``"none"`` LionCub never sees a voter's own gradient) and two voters or more (one has no second batch size)."""
    return options.telemetry.noise_scale and mode_of(options).votes and not gradients_averaged and voters > 1


def refuse_clip_without_norm(options: LionCubConfig) -> None:
    """``LionCub(...)`` built in Python: rule "mean" needs a ``max_norm`` (only a ds_config has a gradient_clipping to
    take it from; the DeepSpeed wiring fills it in before it builds LionCub)."""
    clip = options.clip
    if clip is not None and clip.rule == "mean" and clip.max_norm is None:
        raise LionCubConfigError(
            "LionCub: option clip has no max_norm, and outside a ds_config there is no gradient_clipping to take it "
            "from. Pass clip={'max_norm': 1.0} (the norm to clip the ranks' mean gradient to), or drop clip."
        )


def _max_norm(clip: ClipConfig | None, gradient_clipping: float, written: bool) -> float | None:
    """The norm rule "mean" clips to, None when nothing is to clip; refuses two different explicit norms."""
    if clip is None or clip.max_norm is None:
        if clip is not None and gradient_clipping <= 0:
            raise LionCubConfigError(
                "LionCub: option clip asks to clip the mean gradient but gives no max_norm, and the ds_config's "
                'gradient_clipping is 0. Set "clip": {"max_norm": 1.0} (or gradient_clipping), or drop clip to '
                "train without clipping."
            )
        return gradient_clipping if gradient_clipping > 0 else None
    if written and gradient_clipping > 0 and gradient_clipping != clip.max_norm:
        raise LionCubConfigError(
            f"LionCub: option clip.max_norm ({clip.max_norm:g}) and the ds_config's gradient_clipping "
            f"({gradient_clipping:g}) ask for two different clippings. LionCub clips the mean gradient at "
            f"gradient_clipping by default: drop clip.max_norm, or set gradient_clipping to {clip.max_norm:g} (or 0). "
            f"Under the HF Trainer gradient_clipping comes from max_grad_norm."
        )
    return float(clip.max_norm)


def _deepspeed_rule_line(options: LionCubConfig, gradient_clipping: float) -> str:
    """The log line when DeepSpeed's own clipping runs (or nothing clips)."""
    if gradient_clipping <= 0:
        return "LionCub: no gradient clipping (the ds_config's gradient_clipping is 0)."
    if mode_of(options).exact:
        return (
            f"LionCub: DeepSpeed's gradient_clipping clips the averaged (mean) gradient at {gradient_clipping:g}, "
            f"as exact training clips."
        )
    return (
        f"LionCub: DeepSpeed's own clipping rule ({DEEPSPEED_RULE_JSON}) at {gradient_clipping:g}: each rank's "
        f"gradient is scaled by the mean of the ranks' own norms, which clips harder than exact training and costs "
        f"loss at many voters (+8.2% against +3.2% for the 1-bit vote at 64 voters); drop the rule to clip the mean."
    )


__all__ = [
    "DEEPSPEED_RULE_JSON",
    "DEFAULT_SKETCH_BINS",
    "ClipResolution",
    "measures_noise_scale",
    "refuse_clip_without_norm",
    "resolve_clipping",
    "sketch_bins_of",
]
