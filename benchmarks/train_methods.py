"""The training methods bench_train.py compares, and the settings they share.

Every method trains the same model on the same data with the same lr, weight decay and batch; they
differ only in how gradients (or updates) cross the network and in beta2 where the name says so:

| name | runtime | what crosses the network |
|---|---|---|
| lion_fp32 | DeepSpeed | fp32 gradient all-reduce, then exact Lion (LionCub compression "none") |
| lion_bf16 | DeepSpeed | the same all-reduce in bf16 (``communication_data_type``) |
| lioncub_1bit | DeepSpeed | 1-bit majority vote of the local Lion updates |
| lioncub_1bit_overlap | DeepSpeed | the same vote started from backward's gradient hooks (``overlap``), 2Mi buckets |
| lioncub_4bit_sign | DeepSpeed | 4-bit sums of local signs, voted |
| lioncub_8bit_l1 | DeepSpeed | 8-bit L1-quantized local updates, summed and voted |
| *_b95 | DeepSpeed | the same at beta2 = 0.95 (the paper's setting for 1-bit) |
| lioncub_1bit_b95_sync | DeepSpeed | 1-bit, plus the output head's momentum averaged every 10 steps |
| ddp_bf16 | torch DDP | plain Lion, DDP's ``bf16_compress_hook`` (bf16 gradient all-reduce, overlapped) |
| ddp_powersgd | torch DDP | plain Lion, DDP's PowerSGD hook (rank-2 low-rank gradients) |
| lion_zero2 | DeepSpeed | exact Lion, ZeRO-2 over the whole world: fp32 gradient reduce, fp32 all-gather |
| lioncub_1bit_zero2_hybrid | DeepSpeed | ZeRO-2 in fp32 inside each node; 1-bit vote of each shard across nodes |
| lion_zero3 | DeepSpeed | exact Lion, ZeRO-3 over the whole world: fp32 reduce-scatter, parameter gathers |
| lioncub_1bit_zero3_hybrid | DeepSpeed | ZeRO-3 in fp32 inside each node; 1-bit vote of the slices across nodes |

The k-bit methods use ``kbit_algorithm="alltoall"``: on the emulated cluster it is the faster of the
two (benchmarks/RESULTS.md, compressed collectives) and it computes the same vote. Gradient clipping is off
everywhere (DeepSpeed's default is 1.0): DDP has none, and Lion's update is a sign anyway.

The ZeRO methods are meant for a cluster of nodes with several ranks each (``bench_train.py
--node-size G``): the hybrid's ``hybrid.node_size`` is that G, so its ZeRO groups are the ranks that
share a node's unshaped loopback and its votes are what crosses the shaped links between nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Runtime = Literal["deepspeed", "ddp"]
DdpHook = Literal["bf16", "powersgd"]
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainSettings:
    """What every method shares. ``micro_batch`` x ``seq_len`` tokens per rank per step."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    micro_batch: int = 4
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 8
    d_model: int = 512
    seed: int = 0
    powersgd_rank: int = 2
    # "constant" (bench_train's runs) or "cosine": DeepSpeed's WarmupCosineLR fitted to the run's length, as the
    # convergence study trains (linear warmup from lr/10 over warmup_steps, cosine decay to lr/10 at the last step).
    schedule: str = "constant"
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "n_layer", "n_head", "d_model", "powersgd_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES or self.warmup_steps < 0:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)} and warmup_steps >= 0; got {self.schedule!r}, "
                f"{self.warmup_steps}"
            )
        if not self.lr > 0 or self.weight_decay < 0 or not 0 <= self.beta1 < 1:
            raise ValueError(
                f"need lr > 0, weight_decay >= 0, 0 <= beta1 < 1; got {self.lr}, {self.weight_decay}, {self.beta1}"
            )


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    runtime: Runtime
    beta2: float = 0.99
    lioncub: dict[str, Any] = field(default_factory=dict)  # LionCub options besides lr/betas/weight_decay
    communication_data_type: str | None = None  # DeepSpeed's gradient all-reduce dtype
    ddp_hook: DdpHook | None = None
    reference: str = "lion_fp32"  # the method whose loss this one's quality is compared with
    zero_stage: int = 0  # DeepSpeed ZeRO stage (0: none)
    hybrid: bool = False  # LionCub's ZeRO hybrid, "hybrid": {"node_size": <the cluster's node size>}

    @property
    def compressed(self) -> bool:
        return self.lioncub.get("compression", "none") != "none"


_HEAD_SYNC = {"interval": 10, "layers": ["^lm_head\\."]}

METHODS: tuple[Method, ...] = (
    Method("lion_fp32", "Lion, fp32 all-reduce", "deepspeed", lioncub={"compression": "none"}),
    Method(
        "lion_bf16",
        "Lion, bf16 all-reduce",
        "deepspeed",
        lioncub={"compression": "none"},
        communication_data_type="bf16",
    ),
    Method("lioncub_1bit", "Lion Cub 1-bit vote", "deepspeed", lioncub={"compression": "1bit"}),
    Method(
        "lioncub_1bit_overlap",
        "Lion Cub 1-bit, overlap, 2Mi buckets",
        "deepspeed",
        lioncub={"compression": "1bit", "overlap": True, "bucket_size": 2 * 1024 * 1024},
    ),
    Method(
        "lioncub_4bit_sign",
        "Lion Cub 4-bit sign",
        "deepspeed",
        lioncub={"compression": "kbit", "bits": 4, "quantizer": "sign", "kbit_algorithm": "alltoall"},
    ),
    Method(
        "lioncub_8bit_l1",
        "Lion Cub 8-bit L1",
        "deepspeed",
        lioncub={"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    ),
    Method("ddp_bf16", "DDP + Lion, bf16_compress_hook", "ddp", ddp_hook="bf16"),
    Method("ddp_powersgd", "DDP + Lion, PowerSGD hook", "ddp", ddp_hook="powersgd"),
    Method(
        "lion_fp32_b95",
        "Lion, fp32 all-reduce, β2 0.95",
        "deepspeed",
        beta2=0.95,
        lioncub={"compression": "none"},
        reference="lion_fp32_b95",
    ),
    Method(
        "lioncub_1bit_b95",
        "Lion Cub 1-bit, β2 0.95",
        "deepspeed",
        beta2=0.95,
        lioncub={"compression": "1bit"},
        reference="lion_fp32_b95",
    ),
    Method(
        "lioncub_1bit_b95_sync",
        "Lion Cub 1-bit, β2 0.95, head sync /10",
        "deepspeed",
        beta2=0.95,
        lioncub={"compression": "1bit", "momentum_sync": _HEAD_SYNC},
        reference="lion_fp32_b95",
    ),
    Method("lion_zero2", "Lion, ZeRO-2", "deepspeed", lioncub={"compression": "none"}, zero_stage=2),
    Method(
        "lioncub_1bit_zero2_hybrid",
        "Lion Cub 1-bit, ZeRO-2 hybrid",
        "deepspeed",
        lioncub={"compression": "1bit"},
        zero_stage=2,
        hybrid=True,
    ),
    Method("lion_zero3", "Lion, ZeRO-3", "deepspeed", lioncub={"compression": "none"}, zero_stage=3),
    Method(
        "lioncub_1bit_zero3_hybrid",
        "Lion Cub 1-bit, ZeRO-3 hybrid",
        "deepspeed",
        lioncub={"compression": "1bit"},
        zero_stage=3,
        hybrid=True,
    ),
)
METHODS_BY_NAME: dict[str, Method] = {method.name: method for method in METHODS}

# The ZeRO hybrid against its two neighbours: ZeRO-2 Lion (speed, bytes between nodes) and stage-0 Lion Cub
# 1-bit (optimizer state, validation loss; the quality table keeps exact Lion as every method's reference).
HYBRID = "lioncub_1bit_zero2_hybrid"
HYBRID_ZERO_BASELINE = "lion_zero2"
HYBRID_STAGE0 = "lioncub_1bit"
HYBRID_SPEEDUP_TARGET = 2.0  # step time, hybrid vs ZeRO-2 Lion
HYBRID_BYTES_TARGET = 16.0  # bytes between nodes, ZeRO-2 Lion / hybrid

# Quality targets: these methods must end within QUALITY_TOLERANCE of their reference's validation loss.
QUALITY_TARGETS: tuple[str, ...] = ("lioncub_4bit_sign", "lioncub_8bit_l1")
QUALITY_TOLERANCE = 0.02


def select_methods(names: str) -> list[Method]:
    """``"all"`` or a comma-separated list of names; unknown names are an error that lists the known ones."""
    if names.strip() == "all":
        return list(METHODS)
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in METHODS_BY_NAME]
    if unknown or not chosen:
        raise ValueError(f"unknown method(s) {unknown or names!r}; choose from: {', '.join(METHODS_BY_NAME)}")
    return [METHODS_BY_NAME[name] for name in chosen]


def ds_config(method: Method, settings: TrainSettings, node_size: int = 1, steps: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a DeepSpeed method: one micro-batch per step, no clipping, no scheduler unless
    ``settings.schedule`` is "cosine" (then WarmupCosineLR over ``steps``, the run's length).

    ``node_size`` (ranks per node) is the hybrid's ``hybrid.node_size``; other methods ignore it.
    """
    if method.runtime != "deepspeed":
        raise ValueError(f"{method.name} runs under torch DDP, not DeepSpeed")
    if node_size < 1:
        raise ValueError(f"node_size must be >= 1, got {node_size}")
    if settings.schedule == "cosine" and (steps is None or steps <= settings.warmup_steps):
        raise ValueError(f"a cosine schedule needs the run's steps, more than its {settings.warmup_steps} warmup steps")
    options = dict(method.lioncub)
    if method.hybrid:
        options["hybrid"] = {"node_size": node_size}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "LionCub",
            "params": {
                "lr": settings.lr,
                "betas": [settings.beta1, method.beta2],
                "weight_decay": settings.weight_decay,
                **options,
            },
        },
    }
    if method.zero_stage:
        config["zero_optimization"] = {"stage": method.zero_stage}
    if method.communication_data_type is not None:
        config["communication_data_type"] = method.communication_data_type
    if settings.schedule == "cosine":
        # The same schedule as examples/compare.py and the convergence study (ds_lioncub.simulate.train.lr_ratio).
        config["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": steps,
                "warmup_num_steps": settings.warmup_steps,
                "warmup_type": "linear",
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.1,
            },
        }
    return config


def method_from_json(text: str) -> Method:
    """A method not in :data:`METHODS`, from a JSON object of :class:`Method`'s fields (``name``, ``label``,
    ``runtime`` and any others): what the planner recommends, run as it is written."""
    fields = json.loads(text)
    if not isinstance(fields, dict):
        raise ValueError(f"a method must be a JSON object of Method's fields, got {text!r}")
    return Method(**fields)
