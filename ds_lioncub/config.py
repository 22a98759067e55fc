"""Every LionCub option in one validated model.

The Python API (``LionCub(params, **options)``) and the ds_config ``"optimizer": {"params": ...}``
block go through :func:`parse_config`, so both reject the same bad input with the same message:
the option, the value, what is allowed, and how to fix it.
"""

from __future__ import annotations

from typing import Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError, field_validator, model_validator


class LionCubConfigError(ValueError):
    """A LionCub option has an unknown name, a bad value, or conflicts with another option."""


class MomentumSyncConfig(DeepSpeedConfigModel):
    """Selective momentum synchronisation (DESIGN §2.6).

    ``interval``: every K-th step (t % K == 0) the selected ``exp_avg`` tensors are averaged over
    the data-parallel ranks; 0 never syncs. ``layers``: regexes searched in parameter names
    (``module.named_parameters()`` names), ``"all"``, or ``"auto"`` (nn.Embedding weights and the
    output head, the layers whose momentum drifts most between workers). ``dtype``: precision of the
    averaging collective.
    """

    interval: int = Field(0, ge=0)
    layers: list[str] | Literal["all", "auto"] = "auto"
    dtype: Literal["fp32", "bf16"] = "fp32"

    @field_validator("layers")
    @classmethod
    def _regexes_compile(cls, layers: list[str] | str) -> list[str] | str:
        import re

        if isinstance(layers, list):
            for pattern in layers:
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"layers entry {pattern!r} is not a valid regex: {error}") from None
        return layers


class LionCubConfig(DeepSpeedConfigModel):
    """LionCub's options.

    ``lr``, ``betas``, ``weight_decay``: Lion's hyper-parameters (defaults for every param group).
    ``compression``: "none" (exact Lion on averaged gradients), "1bit" (majority vote of signs) or
    "kbit" (sums of b-bit fields). ``bits``: field width for "kbit". ``quantizer``: what a k-bit
    field carries, the local sign or the L1-quantized update. ``aggregation``: sign of the sum
    ("vote") or the normalised sum ("mean", k-bit only). ``kbit_algorithm``: one uint8 all-reduce
    (needs p*R <= 2**bits-1) or all-to-all + 1-bit all-gather (any world size).
    ``tie_break``: what an exact zero resolves to. ``l1_clip``: tau, the L1 quantizer saturates at
    tau * mean|c|. ``comm_dtype``: precision of the gradient all-reduce with compression "none".
    ``bucket_size``: elements per communication bucket; it bounds the optimizer's temporaries and
    sets how many collectives a step issues (about 2 per bucket). ``check_finite``: with
    compression, every step first agrees (one 4-byte all-reduce) that no rank has a NaN/inf gradient
    and raises on every rank otherwise, since a vote would hide it.
    ``comm_backend_name``: what carries LionCub's collectives, "torch" (torch.distributed: gloo on
    CPU, NCCL on GPU) or "mpi" (mpi4py; the job must be an MPI job whose world is the data-parallel
    group; install with ``pip install "ds_lioncub[mpi]"``). ``cuda_aware``: with "mpi", hand GPU
    buffers straight to a CUDA-aware MPI instead of staging them through pinned host memory.
    """

    lr: float = Field(1e-4, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    compression: Literal["none", "1bit", "kbit"] = "1bit"
    bits: Literal[2, 4, 8] = 4
    quantizer: Literal["sign", "l1"] = "sign"
    aggregation: Literal["vote", "mean"] = "vote"
    kbit_algorithm: Literal["allreduce", "alltoall"] = "allreduce"
    tie_break: Literal["alternate", "positive"] = "alternate"
    l1_clip: float = Field(2.0, gt=0, allow_inf_nan=False)
    comm_dtype: Literal["fp32", "bf16"] = "fp32"
    bucket_size: int = Field(1 << 23, ge=1024)
    check_finite: bool = True
    momentum_sync: MomentumSyncConfig = MomentumSyncConfig()
    comm_backend_name: Literal["torch", "mpi"] = "torch"
    cuda_aware: bool = False

    @field_validator("comm_backend_name", mode="before")
    @classmethod
    def _known_backend(cls, name: Any) -> Any:
        if isinstance(name, str) and name.lower() in ("nccl", "gloo", "hccl", "ccl", "compressed"):
            raise ValueError(
                f"must be 'torch' or 'mpi'; {name!r} is a torch.distributed backend, which 'torch' uses "
                f"already (NCCL on GPU, gloo on CPU, whatever the process group was initialised with)"
            )
        return name

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"both betas must lie in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _options_fit_compression(self) -> "LionCubConfig":
        given = self.model_fields_set
        kbit_only = ("bits", "quantizer", "aggregation", "kbit_algorithm", "l1_clip")
        if self.compression != "kbit":
            for name in kbit_only:
                if name in given:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} only applies to compression='kbit' "
                        f"(compression is {self.compression!r}); set compression='kbit' or drop {name}"
                    )
        if self.compression != "none" and "comm_dtype" in given and self.comm_dtype != "fp32":
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} applies to compression='none' (the uncompressed gradient "
                f"all-reduce); compressed modes send bits, so drop comm_dtype"
            )
        if self.compression == "none" and self.momentum_sync.interval > 0:
            raise ValueError(
                "momentum_sync only applies to compressed modes: with compression='none' every rank's momentum "
                "is already identical; drop momentum_sync or choose compression='1bit' or 'kbit'"
            )
        if self.cuda_aware and self.comm_backend_name != "mpi":
            raise ValueError(
                f"cuda_aware=True only applies to comm_backend_name='mpi' (comm_backend_name is "
                f"{self.comm_backend_name!r}, whose torch.distributed backend reads device memory itself); "
                f"set comm_backend_name='mpi' or drop cuda_aware"
            )
        if self.compression == "kbit" and self.quantizer == "sign" and "l1_clip" in given:
            raise ValueError("l1_clip only applies to quantizer='l1'; set quantizer='l1' or drop l1_clip")
        return self


def _describe(error: dict[str, Any]) -> str:
    location = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown option {location!r}"
    if not location:
        return error["msg"].removeprefix("Value error, ")
    return f"{location}={error['input']!r}: {error['msg'].removeprefix('Value error, ')}"


def parse_config(options: dict[str, Any]) -> LionCubConfig:
    """Validate ``options`` into a :class:`LionCubConfig` or raise :class:`LionCubConfigError`."""
    try:
        return LionCubConfig(**options)
    except ValidationError as error:
        errors = error.errors()
        problems = "; ".join(_describe(e) for e in errors)
        hint = ""
        if any(e["type"] == "extra_forbidden" for e in errors):
            hint = f" Valid options: {', '.join(LionCubConfig.model_fields)}; momentum_sync takes " \
                f"{', '.join(MomentumSyncConfig.model_fields)}."
        raise LionCubConfigError(f"LionCub: invalid options: {problems}.{hint}") from None
