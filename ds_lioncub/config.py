"""Every LionCub option in one validated model, with a docstring under each field.

The Python API (``LionCub(params, **options)``) and the ds_config ``"optimizer": {"params": ...}``
block go through :func:`parse_config`, so both reject the same bad input with the same message:
the option, the value, what is allowed, and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from ds_lioncub.comm.transport import cuda_aware_conflict
from ds_lioncub.comm.vocabulary import (
    Aggregation,
    CommBackendName,
    KbitAlgorithm,
    KbitWidth,
    Quantizer,
    TieBreak,
)
from ds_lioncub.config_types import (
    Duration,
    Flag,
    OptionalRate,
    OptionalReal,
    OptionalWhole,
    Rate,
    Real,
    Whole,
    only_numbers,
)
from ds_lioncub.errors import LionCubConfigError

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

    @model_validator(mode="after")
    def _residual_knobs_only_for_residual(self) -> ErrorFeedbackConfig:
        given = sorted(self.model_fields_set & {"beta", "reset_interval", "storage"})
        if self.kind == "ef21" and given:
            raise ValueError(
                f"{', '.join(given)} only apply to kind 'residual' (ef21 keeps an estimate, not a "
                f"residual); drop them or set kind='residual'"
            )
        return self


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


@dataclass(frozen=True)
class CrossOptionRule:
    """A combination of LionCub options that cannot work together.

    ``option`` is the option the rule governs (the one its message tells to drop or change first);
    ``refuses(config, given)`` is true for a config the rule refuses, where ``given`` holds the options the
    user set (to any value, the default included); ``message(config)`` says why and how to fix it
    (:func:`parse_config` puts "LionCub: invalid options: " before it and a period after).
    """

    option: str
    refuses: Callable[[LionCubConfig, AbstractSet[str]], bool]
    message: Callable[[LionCubConfig], str]


def _kbit_only(name: str) -> CrossOptionRule:
    """``name`` set with a compression other than "kbit", where it would silently do nothing."""
    return CrossOptionRule(
        name,
        lambda config, given: config.compression != "kbit" and name in given,
        lambda config: (
            f"{name}={getattr(config, name)!r} only applies to compression='kbit' "
            f"(compression is {config.compression!r}); set compression='kbit' or drop {name}"
        ),
    )


def _cuda_aware_conflict_of(config: LionCubConfig) -> str:
    """Why the config's cuda_aware cannot go with its comm_backend_name ("": it can); make_transport says the same."""
    return cuda_aware_conflict(config.comm_backend_name, config.cuda_aware) or ""


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

    compression: Literal["none", "1bit", "kbit", "auto"] = "1bit"
    """What crosses the network. "none": exact Lion on averaged gradients; "1bit": majority vote of the ranks' signs;
    "kbit": sums of b-bit fields (see ``bits``, ``quantizer``, ``aggregation``, ``kbit_algorithm``);
    "auto": the mode :mod:`ds_lioncub.planner` predicts fastest on ``network`` for this model and world,
    chosen when the optimizer is built (logged on rank 0; exact Lion, with a warning, when no
    compression pays)."""

    network: NetworkConfig | None = None
    """The links ``compression="auto"`` plans for (required with it, and only used by it); the planner
    behind it: docs/user-guide.md, "Which mode pays on my network"."""

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
    gradient, and raises on every rank otherwise, since a vote would hide it."""

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
    see its block. Only ``compression="kbit"`` with ``quantizer="l1"``; not yet with ``overlap`` or the
    ZeRO-1/2 hybrid."""

    hybrid: HybridConfig | None = None
    """Options of compressed LionCub under ZeRO stage 1, 2 or 3, the hybrid (used there even when not given):
    ``node_size``, the ranks per node, defaults to the launcher's."""

    telemetry: TelemetryConfig = TelemetryConfig()
    """Opt-in parts of the per-step telemetry (``{"vote_stats": true}``); every step's record is
    ``opt.last_step_telemetry`` (docs/user-guide.md, "What each step did")."""

    # Every rule across options, in the order they are checked: a config with several problems is refused with the
    # first rule's message. A new option that depends on another adds its rule here (one entry).
    CROSS_OPTION_RULES: ClassVar[tuple[CrossOptionRule, ...]] = (
        CrossOptionRule(
            "network",
            lambda config, given: config.compression == "auto" and config.network is None,
            lambda config: (
                "compression='auto' needs the network to plan for: add "
                '"network": {"bandwidth": "1gbit", "latency": "50us"} with your links\' figures '
                "(python -m ds_lioncub.planner shows what each mode would cost), or choose the compression yourself"
            ),
        ),
        CrossOptionRule(
            "network",
            lambda config, given: config.compression != "auto" and config.network is not None,
            lambda config: (
                f"network only applies to compression='auto' (compression is {config.compression!r}); "
                f"set compression='auto' or drop network"
            ),
        ),
        CrossOptionRule(
            "comm_dtype",
            lambda config, given: config.compression == "auto" and "comm_dtype" in given,
            lambda config: (
                "comm_dtype is chosen by compression='auto' (exact Lion in fp32 or bf16); drop comm_dtype, "
                "or choose the compression yourself"
            ),
        ),
        _kbit_only("bits"),
        _kbit_only("quantizer"),
        _kbit_only("aggregation"),
        _kbit_only("kbit_algorithm"),
        _kbit_only("l1_clip"),
        CrossOptionRule(
            "comm_dtype",
            lambda config, given: (
                config.compression != "none" and "comm_dtype" in given and config.comm_dtype != "fp32"
            ),
            lambda config: (
                f"comm_dtype={config.comm_dtype!r} applies to compression='none' (the uncompressed gradient "
                f"all-reduce); compressed modes send bits, so drop comm_dtype"
            ),
        ),
        CrossOptionRule(
            "momentum_sync",
            lambda config, given: config.compression == "none" and config.momentum_sync.interval > 0,
            lambda config: (
                "momentum_sync only applies to compressed modes: with compression='none' every rank's momentum "
                "is already identical; drop momentum_sync or choose compression='1bit' or 'kbit'"
            ),
        ),
        CrossOptionRule(
            "telemetry",
            lambda config, given: config.compression == "none" and config.telemetry.vote_stats,
            lambda config: (
                "telemetry.vote_stats only applies to compressed modes (compression='none' takes no vote); drop "
                "telemetry.vote_stats or choose compression='1bit' or 'kbit'"
            ),
        ),
        CrossOptionRule(
            "hybrid",
            lambda config, given: config.compression == "none" and config.hybrid is not None,
            lambda config: (
                "hybrid only applies to compressed modes under ZeRO stage 1, 2 or 3 (with compression='none' ZeRO "
                "shards exact Lion over the whole world); drop hybrid or choose compression='1bit' or 'kbit'"
            ),
        ),
        CrossOptionRule(
            "overlap",
            lambda config, given: config.overlap and config.compression == "none",
            lambda config: (
                "overlap=True starts compressed votes during backward; with compression='none' the gradients "
                "are averaged instead (DDP or DeepSpeed overlap that themselves). Drop overlap or choose "
                "compression='1bit' or 'kbit'"
            ),
        ),
        CrossOptionRule(
            "overlap",
            lambda config, given: config.overlap and config.comm_backend_name != "torch",
            lambda config: (
                f"overlap=True needs collectives that run while backward goes on, which "
                f"comm_backend_name={config.comm_backend_name!r} does not offer yet; use comm_backend_name='torch' "
                f"or drop overlap"
            ),
        ),
        CrossOptionRule(
            "cuda_aware", lambda config, given: bool(_cuda_aware_conflict_of(config)), _cuda_aware_conflict_of
        ),
        CrossOptionRule(
            "error_feedback",
            lambda config, given: config.error_feedback is not None and config.compression != "kbit",
            lambda config: (
                f"error_feedback only applies to compression='kbit' with quantizer='l1' (compression is "
                f"{config.compression!r}: a sign vote or an exact mean rounds nothing off that it could feed back); "
                f"set compression='kbit', quantizer='l1' or drop error_feedback"
            ),
        ),
        CrossOptionRule(
            "error_feedback",
            lambda config, given: (
                config.error_feedback is not None and config.compression == "kbit" and config.quantizer != "l1"
            ),
            lambda config: (
                f"error_feedback only applies to quantizer='l1' (quantizer is {config.quantizer!r}: a sign field "
                f"has no rounding error to feed back); set quantizer='l1' or drop error_feedback"
            ),
        ),
        CrossOptionRule(
            "error_feedback",
            lambda config, given: config.error_feedback is not None and config.overlap,
            lambda config: (
                "error_feedback does not support overlap=True yet (a vote started during backward would update "
                "the feedback state before the final gradients are known); drop overlap or error_feedback"
            ),
        ),
        CrossOptionRule(
            "error_feedback",
            lambda config, given: config.error_feedback is not None and config.hybrid is not None,
            lambda config: (
                "error_feedback does not support the ZeRO-1/2 hybrid yet; drop hybrid (and run ZeRO stage 0) or "
                "drop error_feedback"
            ),
        ),
        CrossOptionRule(
            "error_feedback",
            lambda config, given: (
                config.error_feedback is not None
                and config.error_feedback.kind == "ef21"
                and (config.kbit_algorithm != "alltoall" or config.aggregation != "vote")
            ),
            lambda config: (
                f"error_feedback kind 'ef21' needs kbit_algorithm='alltoall' and aggregation='vote' (got "
                f"{config.kbit_algorithm!r} and {config.aggregation!r}: each chunk's owner keeps the shared "
                f"estimate and applies its sign); set them or use kind 'residual'"
            ),
        ),
        CrossOptionRule(
            "l1_clip",
            lambda config, given: config.compression == "kbit" and config.quantizer == "sign" and "l1_clip" in given,
            lambda config: "l1_clip only applies to quantizer='l1'; set quantizer='l1' or drop l1_clip",
        ),
    )

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

    def summary(self) -> str:
        """The options that shape this mode's step, as ``name=value`` pairs (for the set-up log line)."""
        names = ["compression", "lr", "betas", "weight_decay", "bucket_size"]
        if self.compression == "none":
            names.append("comm_dtype")
        else:
            names += ["tie_break", "check_finite", "overlap"]
        if self.compression == "kbit":
            names += ["bits", "quantizer", "aggregation", "kbit_algorithm"] + (
                ["l1_clip"] if self.quantizer == "l1" else []
            )
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
                f"{', '.join(ErrorFeedbackConfig.model_fields)}; network takes "
                f"{', '.join(NetworkConfig.model_fields)}; "
                f"telemetry takes {', '.join(TelemetryConfig.model_fields)}."
            )
        raise LionCubConfigError(f"LionCub: invalid options: {problems}.{hint}") from None
