"""The option blocks of :class:`~ds_lioncub.config.LionCubConfig`: one model per nested block of options.

``momentum_sync``, ``consistency_check``, ``telemetry``, ``error_feedback``, ``clip``, ``hybrid`` and ``network`` are
each a small validated model with a docstring under every field (docs/options.md is rendered from them);
:mod:`ds_lioncub.config.options` holds the top-level options and :func:`~ds_lioncub.config.parse_config`;
the rules across options are :mod:`ds_lioncub.config.rules`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, field_validator, model_validator

from ds_lioncub.config.strict_types import (
    Duration,
    Flag,
    OptionalRate,
    OptionalReal,
    OptionalWhole,
    Rate,
    Real,
    Whole,
)

CommDtype = Literal["fp32", "bf16"]


class MomentumSyncConfig(DeepSpeedConfigModel):
    """Selective momentum synchronisation: average some layers' ``exp_avg`` over the ranks now and then.

    With compression each rank's momentum drifts from the others'; averaging the layers that drift
    most (embeddings and the output head) every few steps brings Lion Cub closer to Lion for a few
    percent more bytes.
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    def __init__(self, strict: bool = True, **data: Any) -> None:
        # DeepSpeed's config models drop every "auto" value (HF's placeholder), but layers="auto" is a value of its
        # own here: dropped, {"layers": "auto"} would read as an empty block and its missing interval go unnoticed.
        super().__init__(strict=strict, **data)

    interval: Whole = Field(0, ge=0)
    """Every K-th step (t % K == 0) the selected ``exp_avg`` tensors are averaged; 0 never syncs. Try 10.
    ``layers`` or ``dtype`` without an interval, or with interval 0, is refused: they would never take effect."""

    layers: list[str] | Literal["all", "auto"] = "auto"
    """Regexes searched in parameter names (``module.named_parameters()`` names), ``"all"``, or
    ``"auto"``: the nn.Embedding weights and the output head (the last nn.Linear); ``"auto"`` needs the
    model (``LionCub(..., module=model)``; DeepSpeed passes its engine's). An empty list is refused."""

    dtype: CommDtype = "fp32"
    """Precision of the averaging all-reduce; bf16 halves its bytes."""

    @field_validator("layers")
    @classmethod
    def _regexes_compile(cls, layers: list[str] | str) -> list[str] | str:
        if isinstance(layers, list):
            if not layers:
                # An empty list selects nothing: the config says "sync" and the job syncs no momentum, like a
                # regex that matches no parameter name (refused when the optimizer is built).
                raise ValueError(
                    "an empty list selects no parameter, so nothing would be synced; list regexes of parameter "
                    'names (e.g. ["^lm_head\\."]), use "auto" or "all", or drop momentum_sync'
                )
            for pattern in layers:
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"layers entry {pattern!r} is not a valid regex: {error}") from None
        return layers

    @model_validator(mode="after")
    def _interval_given(self) -> MomentumSyncConfig:
        # Layers or a dtype with no interval (or interval 0) would never take effect: the job trains without any
        # sync and nothing says so. The rule reads values, not only which keys were given, so that a valid block
        # stays valid after model_dump() and parsing again (compression="auto" and the engine do that).
        given = [name for name in ("layers", "dtype") if name in self.model_fields_set]
        interval_missing = "interval" not in self.model_fields_set and bool(given)
        non_default = any(getattr(self, name) != type(self).model_fields[name].default for name in given)
        if self.interval == 0 and (interval_missing or non_default):
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in given)
            raise ValueError(
                f"momentum_sync sets {shown} but its interval is {'missing' if interval_missing else '0'}, and "
                f"interval 0 never syncs; set momentum_sync.interval (e.g. 10: every 10th step) or drop momentum_sync"
            )
        return self


class ConsistencyCheckConfig(DeepSpeedConfigModel):
    """Replica checksums: confirm every few steps that all ranks hold bitwise identical parameters."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    interval: Whole = Field(100, ge=0)
    """Every K-th step the ranks compare a checksum of their parameters (one read pass over them and an
    8-byte all-gather) and all raise, naming the step and the parameter, if they differ; 0 never checks.
    At 100 the cost is well under 1% of a step (benchmarks/RESULTS.md)."""


class TelemetryConfig(DeepSpeedConfigModel):
    """What the per-step telemetry measures beyond bytes, collectives and seconds (always recorded).

    Every step's record is :attr:`ds_lioncub.LionCub.last_step_telemetry`; under DeepSpeed it is also
    written through the engine's monitor (docs/design.md, section 15).
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    vote_stats: Flag = False
    """Also measure the vote's tie rate (the fraction of elements whose summed vote is 0) and this
    rank's agreement rate (the fraction whose local sign equals the applied sign). Costs, per bucket,
    a packed copy of the local signs (n/8 bytes), two 1-bit votes or a histogram of the summed fields,
    and a packing of the result; per step one 8-byte integer all-reduce (left out of ``comm_stats()``).
    About 30% of a world-of-one CPU step's time (benchmarks/RESULTS.md). Compressed modes only."""

    noise_scale: Flag = True
    """Measure the job's gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) as it trains,
    from each voter's gradient and the voters' mean (:mod:`ds_lioncub.step.noise_scale`; docs/user-guide.md,
    "The gradient noise scale"). Read it as ``LionCub.noise_scale``, in the step records and, under DeepSpeed,
    as monitor event ``LionCub/noise_scale`` (in samples). Costs one sketch of the gradients and one all-reduce of
    ``clip.sketch_bins + 1`` fp64 numbers per step, shared with option ``clip`` when that clips. Compressed modes
    with two or more voters only: with compression ``"none"`` the gradients are averaged before LionCub sees them,
    and one voter has no second batch size, so there is no estimate (the option is then ignored)."""

    noise_scale_beta: Real = Field(0.99, ge=0, lt=1, allow_inf_nan=False)
    """The weight of the past in the moving averages of |G|^2 and tr(Sigma) the noise scale divides (each step's
    estimate of either is very noisy; the averages are divided, not the steps' ratios). 0.99 averages over about
    100 steps."""


class ErrorFeedbackConfig(DeepSpeedConfigModel):
    """Error feedback on the k-bit L1 path: what the quantizer rounds off one step is fed into the next.

    Two forms (docs/design.md, section 4.8): ``"residual"`` keeps each rank's rounding error and adds a
    moving average of it to the next step's update before quantizing; ``"ef21"`` keeps, on every rank,
    an estimate of its own update and sends only the quantized change of it, with one scale shared by all
    ranks, and applies the sign of the ranks' summed estimate. Both keep every rank's parameters
    bit-identical. ``compression="kbit"`` with ``quantizer="l1"`` only.
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: Literal["residual", "ef21"]
    """``"residual"`` (h = c + e is quantized; e <- beta*e + (1-beta)*(h - dequantized), per rank; any k-bit L1
    aggregation) or ``"ef21"`` (shared-scale EF21: ``kbit_algorithm="alltoall"`` and ``aggregation="vote"``;
    4 B per parameter of estimate per rank plus 4/p B of the shared estimate, one small all-gather per bucket)."""

    beta: Real = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    """``"residual"`` only: the moving average's weight on the old residual (0 keeps only the last step's
    rounding error). Try 0.8-0.95."""

    reset_interval: Whole = Field(0, ge=0)
    """``"residual"`` only: zero the residual every this many uses of a bucket (steps); 0 never resets. The
    residual also starts over when the world size changes."""

    storage: CommDtype = "fp32"
    """``"residual"`` only: the residual's precision in memory, fp32 (4 B per parameter) or bf16 (2 B, rounds
    each stored residual to 8 significant bits)."""

    feed_back: Literal["rounding", "all"] = "rounding"
    """``"residual"`` only: what of ``h - dequantized`` is kept. ``"rounding"``: only the rounding error
    inside the quantizer's range (``h`` clipped to it first), so the residual stays within half a level;
    ``"all"``: all of it, including what the quantizer clips (values beyond its top level, ``l1_clip`` x
    the mean |c|), which then keeps voting in later steps after ``c`` has moved, and widens the gap to Lion
    (benchmarks/RESULTS.md, "Convergence with error feedback")."""

    @model_validator(mode="after")
    def _residual_knobs_only_for_residual(self) -> ErrorFeedbackConfig:
        given = sorted(self.model_fields_set & {"beta", "reset_interval", "storage", "feed_back"})
        if self.kind == "ef21" and given:
            raise ValueError(
                f"{', '.join(given)} only apply to kind 'residual' (ef21 keeps an estimate, not a "
                f"residual); drop them or set kind='residual'"
            )
        return self


#: The fewest bins option ``clip`` takes: below it the estimated norm strays too far for a clip to be trusted
#: (benchmarks/RESULTS.md, "The default clip": at 256 bins the factor's spread is within about +-9% (2 sigma); at
#: 1 or 2 bins a gradient whose factor is 0.2 drew factors from 0.08 to 1.0).
SKETCH_BINS_FLOOR = 256

ClipRuleName = Literal["mean", "deepspeed"]


@dataclass(frozen=True)
class MeanClip:
    """What LionCub clips by when it clips: the ranks' mean gradient to ``max_norm``, its norm from ``sketch_bins``
    bins (:attr:`LionCubConfig.mean_clip <ds_lioncub.config.LionCubConfig.mean_clip>`)."""

    max_norm: float
    sketch_bins: int


class ClipConfig(DeepSpeedConfigModel):
    """How a compressed mode clips: the norm of the ranks' mean gradient, as exact training clips (the default).

    Under compression every rank keeps its own gradient and never forms the mean, so DeepSpeed's own rule scales
    every rank's gradient by a factor from the ranks' *own* norms, which with few samples per rank are several
    times the norm of their mean: it clips harder, every step, and at 64 voters that costs the 1-bit vote 5 points
    of loss (benchmarks/RESULTS.md, "Where the gap comes from"). Rule ``"mean"`` adds every rank's gradient into a
    sketch of ``sketch_bins`` numbers, one all-reduce sums them, and every rank scales its gradient by
    ``min(1, max_norm / (estimated norm of the mean + 1e-6))`` (:mod:`ds_lioncub.step.clipping`).

    Under DeepSpeed a compressed mode clips by rule ``"mean"`` at ``gradient_clipping`` (DeepSpeed's default 1.0)
    whether or not this block is given, and DeepSpeed's own clipping is turned off for the engine, so nothing clips
    twice. ``{"rule": "deepspeed"}`` keeps DeepSpeed's rule, to reproduce a run made before 0.2.0. A number is read
    as ``max_norm`` (``"clip": 1.0`` is ``"clip": {"max_norm": 1.0}``).
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    rule: ClipRuleName = "mean"
    """``"mean"``: clip the ranks' mean gradient by its sketched norm (what exact training does); ``"deepspeed"``:
    leave clipping to DeepSpeed's ``gradient_clipping``, which under compression scales every rank's gradient by the
    mean of the ranks' own norms (the rule before 0.2.0; it trains worse at many voters)."""

    max_norm: OptionalReal = Field(None, gt=0, allow_inf_nan=False)
    """The largest norm the ranks' mean gradient keeps. Under DeepSpeed it defaults to the ds_config's
    ``gradient_clipping``; written in both, the two must agree. ``LionCub(...)`` in Python needs it."""

    sketch_bins: Whole = Field(4093, le=1 << 19)
    """K, the numbers each rank sums into: an all-reduce of 8K bytes per step, and an estimate whose relative
    error is about ``sqrt(2 / K)`` of the squared norm (2% at the default). A prime keeps the columns of
    power-of-two wide matrices apart. At least 256 (fewer make the estimated norm, and so the factor, stray by
    more than 9%); more than 2**19 is refused (the sketch works in 2**20-element chunks, and its table of signs,
    1,048,573 long, must not be a multiple of it)."""

    @field_validator("sketch_bins")
    @classmethod
    def _enough_bins(cls, bins: int) -> int:
        if bins < SKETCH_BINS_FLOOR:
            raise ValueError(
                f"fewer than {SKETCH_BINS_FLOOR} bins make the estimated norm, and so the clipping factor, stray by "
                f"more than 9% from step to step (at 1 or 2 bins some steps do not clip at all); use at least "
                f"{SKETCH_BINS_FLOOR}, or leave out sketch_bins for the default 4093 (8 bytes each per step)"
            )
        return bins

    @model_validator(mode="after")
    def _deepspeed_rule_takes_no_knobs(self) -> ClipConfig:
        given = sorted(self.model_fields_set & {"max_norm", "sketch_bins"})
        if self.rule == "deepspeed" and given:
            raise ValueError(
                f"rule 'deepspeed' clips with DeepSpeed's gradient_clipping, so {' and '.join(given)} would not be "
                f"used; drop {' and '.join(given)}, or drop rule to clip the mean gradient"
            )
        return self


def clip_block(value: Any) -> Any:
    """``"clip": 1.0`` is ``{"max_norm": 1.0}``; a boolean is ambiguous (off, or DeepSpeed's rule?) and refused."""
    if isinstance(value, bool):
        raise ValueError(
            'true/false is not a clipping rule. To keep DeepSpeed\'s rule write "clip": {"rule": "deepspeed"}; '
            'to clip nothing set "gradient_clipping": 0; to clip the mean gradient write "clip": {"max_norm": 1.0}'
        )
    if isinstance(value, int | float):
        return {"max_norm": value}
    if value is not None and not isinstance(value, dict | ClipConfig):
        raise ValueError(
            'must be a block such as {"max_norm": 1.0} or {"rule": "deepspeed"}, or a number (the max_norm)'
        )
    return value


class HybridConfig(DeepSpeedConfigModel):
    """Compressed LionCub under DeepSpeed ZeRO-1/2/3: shard inside a node, vote across nodes.

    N ranks run as M nodes of G ranks. Inside a node ZeRO averages gradients and partitions the
    optimizer state (at stage 3 the parameters too) in full precision; each node is one Lion Cub
    worker, and rank (k, j) votes on shard j with the ranks (k', j) of the other nodes. The engine's
    data-parallel world stays N.
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    node_size: OptionalWhole = Field(None, ge=1)
    """G, the ranks per node. Default: the launcher's ranks per machine (LOCAL_WORLD_SIZE, LOCAL_SIZE,
    OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS); set it to emulate nodes on one machine."""


class NetworkConfig(DeepSpeedConfigModel):
    """The network that ``compression="auto"`` plans for (:mod:`ds_lioncub.planner`).

    The numbers are the user's, not measured by a start-up probe. Every rank reads the same numbers
    and so resolves the same mode, with no collective and no agreement step; a probe would measure a
    different value on every rank (and need one rank's value broadcast to all), would measure the
    links while the job is still starting (ranks loading, connections being set up), and would let
    the mode, and with it the training run, change from one launch to the next. Measure the links
    once (``iperf3``, or ``benchmarks/bench_comm.py``) and write the figures here.
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    bandwidth: Rate = Field(gt=0, allow_inf_nan=False)
    """Each node's link to the network, per direction: a rate such as "1gbit", "100gbit" or "10GB/s" (bits
    or bytes per second, tc's units), or a number of bytes per second. The node's ranks share it."""

    latency: Duration = Field(50e-6, ge=0, allow_inf_nan=False)
    """Seconds per round of a collective (the time for a small message to arrive): "5us", "50us", "1ms", or
    a number of seconds. Default 50us."""

    intra_node_bandwidth: OptionalRate = Field(None, gt=0, allow_inf_nan=False)
    """Between two ranks of one node, per direction; unset: in-node links are no bottleneck (NVLink
    next to Ethernet). Set it when the ranks of a node talk over something slow."""

    ring_efficiency: OptionalReal = Field(None, gt=0, le=1, allow_inf_nan=False)
    """The fraction of the link rate ring collectives (all-reduce, all-gather, reduce-scatter) reach; unset:
    on CPU ranks gloo's, as measured on an emulated network (``ds_lioncub.planner.GLOO_LINK_EFFICIENCY``,
    0.9), on CUDA ranks NCCL's (1: it comes near the link rate)."""

    all_to_all_efficiency: OptionalReal = Field(None, gt=0, le=1, allow_inf_nan=False)
    """The same for pairwise all-to-alls (the 1-bit vote's first collective); unset: gloo's 0.68 on CPU
    ranks (which favours modes built on all-reduces), NCCL's 1 on CUDA ranks."""

    device_bandwidth: OptionalRate = Field(None, gt=0, allow_inf_nan=False)
    """The GPUs' memory bandwidth, which prices the local work of CUDA ranks (a table derived from each
    pass's bytes, ``ds_lioncub.planner.devices``): a rate such as "3.35TB/s"; unset: an H100's (3.35TB/s). CPU ranks
    use the built-in measured table and ignore it."""


class JobConfig(DeepSpeedConfigModel):
    """What ``compression="auto"`` knows of the job besides its network: its global batch against its gradient noise
    scale, and its compute per step. They decide how many more steps a compressed mode needs to reach exact Lion's
    loss (r) and what those steps cost, as the planner's ``--global-batch``, ``--noise-scale`` and
    ``--compute-per-step`` do (docs/user-guide.md, "What a mode costs in steps"). Unset, r is its worst case."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    global_batch: OptionalReal = Field(None, gt=0, allow_inf_nan=False)
    """Samples per optimizer step over the whole job (micro-batch x gradient accumulation x data-parallel ranks), in
    the unit of ``noise_scale``; unset: not known."""

    noise_scale: OptionalReal = Field(None, gt=0, allow_inf_nan=False)
    """The gradient noise scale B_simple, in samples, as LionCub measures it (``LionCub.noise_scale``, the monitor's
    ``LionCub/noise_scale``; an earlier run's average over its steps); needs ``global_batch``. Unset: not known,
    and r is its worst case, 1/kappa."""

    compute_per_step: Duration = Field(0.0, ge=0, allow_inf_nan=False)
    """The forward and backward passes' seconds per optimizer step ("280ms", or a number of seconds): the same in
    every mode, and paid r times by a mode that needs r times exact Lion's steps. Default 0: not counted."""

    @model_validator(mode="after")
    def _noise_scale_needs_the_batch(self) -> JobConfig:
        if self.noise_scale is not None and self.global_batch is None:
            raise ValueError(
                "noise_scale needs global_batch (r depends on the batch over the noise scale, B/B_noise): add "
                '"global_batch" in the same samples, e.g. "global_batch": 1024'
            )
        return self


__all__ = [
    "ClipConfig",
    "CommDtype",
    "ConsistencyCheckConfig",
    "ErrorFeedbackConfig",
    "HybridConfig",
    "JobConfig",
    "MomentumSyncConfig",
    "NetworkConfig",
    "TelemetryConfig",
]
