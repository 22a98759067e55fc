"""Every LionCub option in one validated model, with a docstring under each field.

The Python API (``LionCub(params, **options)``) and the ds_config ``"optimizer": {"params": ...}``
block go through :func:`parse_config`, so both reject the same bad input with the same message:
the option, the value, what is allowed, and how to fix it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from ds_lioncub.comm.vocabulary import (
    Aggregation,
    CommBackendName,
    KbitAlgorithm,
    KbitWidth,
    Quantizer,
    TieBreak,
)
from ds_lioncub.config.rules import CROSS_OPTION_RULES, CrossOptionRule
from ds_lioncub.config.sections import (
    ClipConfig,
    CommDtype,
    ConsistencyCheckConfig,
    ErrorFeedbackConfig,
    HybridConfig,
    JobConfig,
    MeanClip,
    MomentumSyncConfig,
    NetworkConfig,
    TelemetryConfig,
    clip_block,
)
from ds_lioncub.config.strict_types import (
    Flag,
    Real,
    Whole,
    only_numbers,
)
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import MODE_NAMES, mode_of

if TYPE_CHECKING:
    CompressionName = str
else:
    # The registered modes' names (ds_lioncub.modes), as pydantic checks them and the options' reference lists them:
    # a new mode registers there, not here.
    CompressionName = Literal[MODE_NAMES]


class LionCubConfig(DeepSpeedConfigModel):
    """LionCub's options: the ``"params"`` of ``"optimizer": {"type": "LionCub"}`` and ``LionCub(**options)``.

    Validated: an unknown key or a bad value raises ``LionCubConfigError`` naming the problem. Types are
    strict, in the ds_config and in ``LionCub(...)`` alike: booleans are not numbers (``"lr": true`` is
    refused, not read as 1), strings are not numbers (``"bits": "4"``: write ``4``), and only ``true`` /
    ``false`` are booleans (not ``0``, ``1`` or ``"false"``). A JSON integer where a real is expected
    (``"weight_decay": 0``) and a whole real where an integer is expected (``"bucket_size": 5e8``) are the
    same number and fine; ``network``'s rates and latencies are strings with units (``"1gbit"``, ``"50us"``)
    or plain numbers. No option takes NaN, an infinity or a negative number.
    """

    model_config = ConfigDict(use_attribute_docstrings=True)

    def __init__(self, strict: bool = False, **data: Any) -> None:
        # DeepSpeed's config models drop every "auto" value (a placeholder that HF's integration fills in);
        # compression="auto" is an option of its own and must survive that.
        if not strict and data.get("compression") == "auto":
            data = {key: value for key, value in data.items() if value != "auto" or key == "compression"}
            strict = True
        super().__init__(strict=strict, **data)

    lr: Real = Field(1e-4, ge=0, allow_inf_nan=False)
    """Learning rate, the default of every param group. Lion wants 3-10x less than AdamW."""

    betas: tuple[Real, Real] = (0.9, 0.99)
    """(beta1, beta2), two reals in [0, 1): beta1 mixes momentum and gradient into the update, beta2 is the
    momentum's EMA."""

    weight_decay: Real = Field(0.0, ge=0, allow_inf_nan=False)
    """Decoupled weight decay; Lion wants 3-10x more than AdamW (lr * wd is what matters)."""

    compression: CompressionName = "1bit"
    """What crosses the network. "none": exact Lion on averaged gradients; "1bit": majority vote of the ranks' signs;
    "kbit": sums of b-bit fields (see ``bits``, ``quantizer``, ``aggregation``, ``kbit_algorithm``);
    "auto": the mode :mod:`ds_lioncub.planner` predicts fastest on ``network`` for this model and world,
    chosen when the optimizer is built (logged on rank 0; exact Lion, with a warning, when no
    compression pays). A mode the convergence study shows losing more than 2% of Lion's loss at the
    voters' count and ``betas[1]`` (the 95% Student-t interval of its gap above 2%) is passed over, with a
    warning; where the interval is too wide to tell, the mode is kept and the logged line gives its
    interval."""

    network: NetworkConfig | None = None
    """The links ``compression="auto"`` plans for (required with it, and only used by it); the planner
    behind it: docs/user-guide.md, "Which mode pays on my network"."""

    job: JobConfig | None = None
    """The job's global batch, gradient noise scale and compute per step, for ``compression="auto"`` (only used by
    it): with them it ranks the modes by the time to exact Lion's loss at your batch instead of the worst case."""

    bits: Annotated[KbitWidth, BeforeValidator(only_numbers)] = 4
    """Field width for "kbit": 2, 4 or 8 bits per element."""

    quantizer: Quantizer = "sign"
    """What a k-bit field carries: the local sign ("sign"), or the L1-quantized update ("l1"):
    ``clamp(round(c/mean|c| * L / l1_clip), -L, L)`` per tensor, L the quantizer's levels."""

    aggregation: Aggregation = "vote"
    """k-bit only: apply the sign of the summed fields ("vote") or the sum normalised to [-1, 1] ("mean")."""

    kbit_algorithm: KbitAlgorithm = "allreduce"
    """One uint8 SUM all-reduce of the packed fields (needs ``p * R <= 2**bits - 1``, R a field's largest
    value: p <= ``2**bits - 1`` for sign, ``(2**bits - 1) // 2`` for l1), or all-to-all + 1-bit all-gather
    (any world size p). The all-reduce holds 3 / 15 / 255 workers with sign fields at 2 / 4 / 8 bits, and
    1 / 7 / 127 with L1 fields; beyond that LionCub refuses at construction and names the alternatives
    (``kbit_algorithm="alltoall"``, more bits, or ``"1bit"``)."""

    tie_break: TieBreak = "alternate"
    """What an exact zero (a zero local sign or a tied vote) resolves to: +1 on odd steps and -1 on even
    ones ("alternate"), or always +1 ("positive")."""

    l1_clip: Real = Field(2.0, gt=0, allow_inf_nan=False)
    """tau: the L1 quantizer saturates at ``l1_clip * mean|c|``."""

    comm_dtype: CommDtype = "fp32"
    """Precision of the gradient all-reduce, compression "none" only."""

    bucket_size: Whole = Field(1 << 23, ge=1024)
    """Elements per communication bucket: bounds the optimizer's temporaries and sets how many
    collectives a step issues (about 2 per bucket)."""

    check_finite: Flag = True
    """Compressed modes: every step first agrees (one 4-byte all-reduce) that no rank has a NaN/inf
    gradient, and raises on every rank otherwise, since a vote would hide it. Where the step sketches its
    gradients (option `clip`, `telemetry.noise_scale`), the sketch's all-reduce carries the verdict instead
    (one more fp64 number), so the check costs no collective of its own."""

    momentum_sync: MomentumSyncConfig = MomentumSyncConfig()
    """Selective momentum synchronisation (compressed modes only): every ``interval`` steps average the
    ``exp_avg`` of the selected layers over the ranks. The default (interval 0) never syncs."""

    comm_backend_name: CommBackendName = "torch"
    """What carries LionCub's collectives: "torch" (torch.distributed: gloo on CPU, NCCL on GPU) or
    "mpi" (mpi4py; the job must be an MPI job whose world is the data-parallel group; install with
    ``pip install "ds_lioncub[mpi]"``)."""

    cuda_aware: Flag = False
    """With "mpi", hand GPU buffers straight to a CUDA-aware MPI instead of staging them through
    pinned host memory."""

    overlap: Flag = False
    """Start each bucket's vote during backward instead of in ``step()``: as soon as a bucket's gradients
    are accumulated, its message is packed and sent while backward goes on. ``step()`` packs every bucket
    again from the final gradients (after clipping or unscaling) and one small all-reduce agrees which
    buckets some rank sent differently; those are voted again, so every result is bit-identical to
    ``overlap=False``. Arm it on the last micro-step: ``optimizer.overlap_next_backward()`` before
    ``loss.backward()`` (DeepSpeed's ``engine.backward`` arms its accumulation-boundary backward itself).
    Compressed modes with comm_backend_name "torch" at ZeRO stage 0 (fp32, fp16 or bf16); it uses a
    second process group over the same ranks. On CPU the hooks' packing lengthens backward and step()
    packs again: it pays where the wire, not the processor, is the bottleneck (benchmarks/RESULTS.md)."""

    consistency_check: ConsistencyCheckConfig = ConsistencyCheckConfig()
    """Replica checksums every ``interval`` steps (default 100); interval 0 turns them off."""

    error_feedback: ErrorFeedbackConfig | None = None
    """Error feedback on the k-bit L1 path (default: none): ``{"kind": "residual"}`` or ``{"kind": "ef21"}``,
    see its block. Only ``compression="kbit"`` with ``quantizer="l1"``; at every ZeRO stage (under the ZeRO
    hybrid each rank keeps the state of its shard); not yet with ``overlap``."""

    clip: Annotated[ClipConfig | None, BeforeValidator(clip_block)] = None
    """How the gradients are clipped, see its block. Under DeepSpeed a compressed mode clips the ranks' mean
    gradient by its sketched norm at ``gradient_clipping`` (DeepSpeed's default 1.0) when this is not given, in
    place of DeepSpeed's own clipping; ``{"rule": "deepspeed"}`` keeps DeepSpeed's rule; ``{"max_norm": 1.0}``
    (or ``1.0``) sets the norm. In Python (``LionCub(...)`` without DeepSpeed) nothing clips unless this sets a
    ``max_norm``. Under ZeRO, rule ``"mean"`` needs the hybrid (compressed modes): exact Lion clips with
    DeepSpeed's ``gradient_clipping``, which clips its averaged gradient exactly."""

    hybrid: HybridConfig | None = None
    """Options of compressed LionCub under ZeRO stage 1, 2 or 3, the hybrid (used there even when not given):
    ``node_size``, the ranks per node, defaults to the launcher's."""

    telemetry: TelemetryConfig = TelemetryConfig()
    """What the per-step telemetry measures beyond bytes and seconds: the gradient noise scale (on by default for
    compressed modes, ``{"noise_scale": false}`` turns it off) and the vote's statistics (``{"vote_stats": true}``);
    every step's record is ``opt.last_step_telemetry`` (docs/user-guide.md, "What each step did")."""

    #: Every rule across options, in the order they are checked (ds_lioncub.config.rules): a config with several
    #: problems is refused with the first rule's message. A new option that depends on another adds its rule there.
    CROSS_OPTION_RULES: ClassVar[tuple[CrossOptionRule, ...]] = CROSS_OPTION_RULES

    @field_validator("comm_backend_name", mode="before")
    @classmethod
    def _known_backend(cls, name: Any) -> Any:
        if isinstance(name, str) and name.lower() in ("nccl", "gloo", "hccl", "ccl", "compressed"):
            raise ValueError(
                f"must be 'torch' or 'mpi'; {name!r} is a torch.distributed backend, which 'torch' uses "
                f"already (NCCL on GPU, gloo on CPU, whatever the process group was initialised with)"
            )
        return name

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, betas: Any) -> Any:
        # Without this a one-element list reads "betas.1=[0.9]: Field required", which names neither the
        # option's shape nor the fix.
        if isinstance(betas, str | bytes | dict | int | float) or (isinstance(betas, list | tuple) and len(betas) != 2):
            raise ValueError("must be two numbers (beta1, beta2) in [0, 1), e.g. [0.9, 0.99]")
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"both betas must lie in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _options_fit_together(self) -> LionCubConfig:
        given = self.model_fields_set
        for rule in self.CROSS_OPTION_RULES:
            if rule.refuses(self, given):
                raise ValueError(rule.message(self))
        return self

    @property
    def mean_clip(self) -> MeanClip | None:
        """What LionCub clips by (option ``clip``, rule ``"mean"`` with a ``max_norm``), else None: DeepSpeed's rule,
        or nothing clips. Under DeepSpeed the wiring resolves the rule first (:mod:`ds_lioncub.config.clip_rule`)."""
        clip = self.clip
        if clip is None or clip.rule != "mean" or clip.max_norm is None:
            return None
        return MeanClip(max_norm=clip.max_norm, sketch_bins=clip.sketch_bins)

    def summary(self) -> str:
        """The options that shape this mode's step, as ``name=value`` pairs (for the set-up log line)."""
        names = ["compression", "lr", "betas", "weight_decay", "bucket_size"]
        names += mode_of(self).shown_options(self)
        names.append("comm_backend_name")
        if self.comm_backend_name == "mpi":
            names.append("cuda_aware")
        pairs = [f"{name}={getattr(self, name)!r}" for name in names]
        if self.momentum_sync.interval:
            sync = self.momentum_sync
            pairs.append(f"momentum_sync=(interval={sync.interval}, layers={sync.layers!r}, dtype={sync.dtype!r})")
        if self.error_feedback is not None:
            feedback = self.error_feedback
            knobs = (
                ""
                if feedback.kind == "ef21"
                else (f", beta={feedback.beta}, reset_interval={feedback.reset_interval}, storage={feedback.storage!r}")
            )
            pairs.append(f"error_feedback=(kind={feedback.kind!r}{knobs})")
        if self.mean_clip is not None:
            pairs.append(f"clip=(max_norm={self.mean_clip.max_norm}, sketch_bins={self.mean_clip.sketch_bins})")
        if self.telemetry.vote_stats:
            pairs.append("telemetry.vote_stats=True")
        return ", ".join(pairs)


# What to add for a required field that is missing (pydantic's own "Field required" shows the enclosing block as
# the value, which reads as if that block were the bad value).
_MISSING_FIXES = {
    "network.bandwidth": 'add "bandwidth" with your nodes\' link rate, e.g. "bandwidth": "1gbit" ("100gbit", "10GB/s")',
}


def _describe(error: ErrorDetails) -> str:
    location = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown option {location!r}"
    if error["type"] == "missing":
        return f"{location} is required: {_MISSING_FIXES.get(location, 'add it')}"
    if not location:
        return error["msg"].removeprefix("Value error, ")
    return f"{location}={error['input']!r}: {error['msg'].removeprefix('Value error, ')}"


def parse_config(options: dict[str, Any]) -> LionCubConfig:
    """Validate ``options`` into a :class:`LionCubConfig` or raise :class:`LionCubConfigError` naming
    every problem, the valid options and the fix."""
    try:
        return LionCubConfig(**options)
    except ValidationError as error:
        errors = error.errors()
        problems = "; ".join(_describe(e) for e in errors)
        hint = ""
        if any(e["type"] == "extra_forbidden" for e in errors):
            hint = (
                f" Valid options: {', '.join(LionCubConfig.model_fields)}; momentum_sync takes "
                f"{', '.join(MomentumSyncConfig.model_fields)}; consistency_check takes "
                f"{', '.join(ConsistencyCheckConfig.model_fields)}; hybrid takes "
                f"{', '.join(HybridConfig.model_fields)}; error_feedback takes "
                f"{', '.join(ErrorFeedbackConfig.model_fields)}; clip takes "
                f"{', '.join(ClipConfig.model_fields)}; network takes "
                f"{', '.join(NetworkConfig.model_fields)}; job takes {', '.join(JobConfig.model_fields)}; "
                f"telemetry takes {', '.join(TelemetryConfig.model_fields)}."
            )
        raise LionCubConfigError(f"LionCub: invalid options: {problems}.{hint}") from None
