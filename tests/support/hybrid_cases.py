"""The scenarios of the ZeRO hybrid tests (compressed LionCub under ZeRO-1/2: shard inside a node, vote across nodes).

Shared by the deepspeed-launched worker (tests/workers/hybrid_scenarios.py), which runs them, and by
tests/integration/test_zero_hybrid.py, which rebuilds every rank's inputs from here and runs the plain-torch
simulation (tests.support.reference.simulate_hybrid). Every input is a pure function of (rank, step,
micro-batch), and the model starts from a fixed seed, so both sides see the same numbers.

The model has 195 parameters, an odd count, so ZeRO pads every flat group and the padding is exercised.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

WORLD = 4
NODE_SIZE = 2
NODES = WORLD // NODE_SIZE
STEPS = 6
CHECKPOINT_AT = 3
MICRO_BATCH = 4
LR = 1e-2
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
BIAS_WEIGHT_DECAY = 0.0
BINDING_CLIP = 0.05  # far below every node's gradient norm here, so every step clips
# LionCub's option clip: a norm the 2 nodes' mean gradient crosses during the run; fewer bins than a shard holds.
OPTION_CLIP = {"max_norm": 0.7, "sketch_bins": 263}
# DeepSpeed's own clipping rule, kept by name (the default before 0.2.0).
DEEPSPEED_RULE = {"rule": "deepspeed"}
NAN_RANK, NAN_STEP = 3, 3
WARMUP = {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}


def build_model() -> nn.Module:
    """An fp32 MLP 8-16-3 from a fixed seed: the same initial parameters in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s inputs and targets for micro-batch ``micro`` of engine step ``step`` (1-based)."""
    generator = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + micro)
    return torch.randn(MICRO_BATCH, 8, generator=generator), torch.randn(MICRO_BATCH, 3, generator=generator)


def loss_of(model: nn.Module, rank: int, step: int, micro: int, nan_at: tuple[int, int] | None) -> Tensor:
    """The micro-batch's mean squared error; times NaN on rank/step ``nan_at`` (a broken gradient on one rank)."""
    x, y = batch(rank, step, micro)
    # bf16 engines get bf16 inputs; the loss is taken in fp32 (no-ops for the fp32 model)
    dtype = next(model.parameters()).dtype
    loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
    if nan_at == (rank, step):
        loss = loss * float("nan")
    return loss


@dataclass(frozen=True)
class HybridCase:
    """One engine configuration and how long to train it.

    ``node_size`` None leaves the ``hybrid`` key out; ``options`` are LionCub params beyond lr, betas
    and weight decay; ``bias_groups`` gives weights and biases their own param groups (the biases
    without weight decay).
    """

    name: str
    stage: int = 2
    node_size: int | None = NODE_SIZE
    options: dict[str, Any] = field(default_factory=lambda: {"compression": "1bit"})
    steps: int = STEPS
    accumulation: int = 1
    clipping: float = 0.0
    scheduler: dict[str, Any] | None = None
    nan_at: tuple[int, int] | None = None
    bias_groups: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def ds_config(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "lr": LR,
            "betas": list(BETAS),
            "weight_decay": WEIGHT_DECAY,
            **copy.deepcopy(self.options),
        }
        if self.node_size is not None:
            params["hybrid"] = {"node_size": self.node_size}
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": self.accumulation,
            "gradient_clipping": self.clipping,
            "optimizer": {"type": "LionCub", "params": params},
        }
        if self.stage > 0:
            config["zero_optimization"] = {"stage": self.stage}
        if self.scheduler is not None:
            config["scheduler"] = copy.deepcopy(self.scheduler)
        for key, value in self.extra.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **copy.deepcopy(value)}
            else:
                config[key] = copy.deepcopy(value)
        return config

    def lioncub_clip(self) -> tuple[float, int] | None:
        """(max_norm, sketch_bins) where LionCub clips the mean gradient, as docs/options.md (clip) states the rule:
        a compressed mode clips at clip.max_norm, else at the ds_config's gradient_clipping, with 4093 bins unless
        clip.sketch_bins says otherwise; never with compression "none" or ``{"rule": "deepspeed"}``."""
        clip = self.options.get("clip") or {}
        if self.options.get("compression", "1bit") == "none" or clip.get("rule") == "deepspeed":
            return None
        max_norm = clip.get("max_norm", self.clipping)
        return (max_norm, clip.get("sketch_bins", 4093)) if max_norm else None

    def simulated_clipping(self) -> float:
        """DeepSpeed's gradient_clipping as the job runs it: off (0) where LionCub clips instead."""
        return 0.0 if self.lioncub_clip() is not None else self.clipping

    def model_parameters(self, model: nn.Module) -> Any:
        """What ``deepspeed.initialize`` gets as ``model_parameters``."""
        if not self.bias_groups:
            return model.parameters()
        named = list(model.named_parameters())
        return [
            {"params": [p for name, p in named if name.endswith("weight")]},
            {"params": [p for name, p in named if name.endswith("bias")], "weight_decay": BIAS_WEIGHT_DECAY},
        ]

    def simulation_options(self) -> dict[str, Any]:
        """The LionCub options as keyword arguments of ``simulate_hybrid``."""
        names = (
            "compression",
            "bits",
            "quantizer",
            "aggregation",
            "kbit_algorithm",
            "tie_break",
            "l1_clip",
            "bucket_size",
            "error_feedback",
        )
        options = {name: self.options[name] for name in names if name in self.options}
        clip = self.lioncub_clip()
        if clip is not None:
            options["sketch_clip"] = clip
        sync = self.options.get("momentum_sync")
        if sync:
            options["momentum_sync_interval"] = sync["interval"]
        return options


def _sync_all(interval: int) -> dict[str, Any]:
    return {"compression": "1bit", "momentum_sync": {"interval": interval, "layers": "all"}}


def kbit_l1_with_feedback(bits: int, algorithm: str, feedback: dict[str, Any], **more: Any) -> dict[str, Any]:
    """k-bit L1 options with error feedback ``feedback``."""
    options = {"compression": "kbit", "bits": bits, "quantizer": "l1", "kbit_algorithm": algorithm}
    return {**options, "error_feedback": feedback, **more}


# Error feedback under the hybrid: the residual with a reset inside the run (steps 5 and 6 restart the
# clock), and EF21 on two param groups (two flat shards, which ZeRO steps in two calls: two bucket keys).
EF_RESIDUAL = HybridCase(
    "zero2_ef_residual_2bit_alltoall",
    options=kbit_l1_with_feedback(
        2, "alltoall", {"kind": "residual", "beta": 0.8, "reset_interval": 4, "feed_back": "all"}
    ),
)
EF21 = HybridCase(
    "zero1_ef21_4bit_alltoall_two_param_groups",
    stage=1,
    bias_groups=True,
    options=kbit_l1_with_feedback(4, "alltoall", {"kind": "ef21"}),
)
EF_CASES = [
    EF_RESIDUAL,
    EF21,
    HybridCase(
        "zero2_ef_residual_bf16_storage_4bit_allreduce_mean_nan_on_one_rank",
        nan_at=(NAN_RANK, NAN_STEP),
        accumulation=2,
        options=kbit_l1_with_feedback(4, "allreduce", {"kind": "residual", "storage": "bf16"}, aggregation="mean"),
    ),
    HybridCase(
        "zero2_ef21_2bit_node_size1", node_size=1, options=kbit_l1_with_feedback(2, "alltoall", {"kind": "ef21"})
    ),
]

# Telemetry's vote statistics, on in two trained scenarios: they must not change a bit of the result.
VOTE_STATS: dict[str, Any] = {"telemetry": {"vote_stats": True}}

# Trained in the main launch and compared with the simulation, each with a fresh engine.
TRAINED = [
    HybridCase("zero1_1bit", stage=1),
    HybridCase("zero2_1bit", stage=2),
    HybridCase("zero2_kbit_sign_4bit_allreduce", options={"compression": "kbit", "bits": 4, "quantizer": "sign"}),
    HybridCase(
        "zero2_kbit_l1_8bit_alltoall",
        options={"compression": "kbit", "bits": 8, "quantizer": "l1", "kbit_algorithm": "alltoall", **VOTE_STATS},
    ),
    HybridCase(
        "zero1_kbit_l1_4bit_allreduce_mean",
        stage=1,
        options={"compression": "kbit", "bits": 4, "quantizer": "l1", "aggregation": "mean"},
    ),
    HybridCase("zero2_1bit_positive_ties", options={"compression": "1bit", "tie_break": "positive"}),
    # DeepSpeed's own rule, named (the default before 0.2.0): each node clipped by its own norm, bit for bit as before.
    HybridCase(
        "zero2_1bit_binding_clip", clipping=BINDING_CLIP, options={"compression": "1bit", "clip": DEEPSPEED_RULE}
    ),
    HybridCase(
        "zero2_1bit_nan_on_one_rank", nan_at=(NAN_RANK, NAN_STEP), options={"compression": "1bit", **VOTE_STATS}
    ),
    HybridCase("zero2_1bit_warmup_lr", scheduler={"type": "WarmupLR", "params": WARMUP}),
    HybridCase("zero1_1bit_accumulation2", stage=1, accumulation=2),
    HybridCase("zero2_1bit_accumulation2", stage=2, accumulation=2),
    HybridCase("zero2_1bit_two_param_groups", bias_groups=True),
    # Option clip: one factor from every shard of every param group (two groups: two calls of LionCub.step).
    HybridCase(
        "zero2_1bit_option_clip_two_param_groups",
        bias_groups=True,
        options={"compression": "1bit", "clip": OPTION_CLIP},
    ),
    # The default: gradient_clipping alone clips the mean gradient by its sketch (here with fewer bins).
    HybridCase(
        "zero2_1bit_default_clip_accumulation2",
        accumulation=2,
        clipping=OPTION_CLIP["max_norm"],
        options={"compression": "1bit", "clip": {"sketch_bins": OPTION_CLIP["sketch_bins"]}},
    ),
    HybridCase(
        "zero2_1bit_option_clip_nan_on_one_rank",
        nan_at=(NAN_RANK, NAN_STEP),
        options={"compression": "1bit", "clip": OPTION_CLIP},
    ),
    # The default with no clip block at all: the mean gradient at gradient_clipping, 4093 bins.
    HybridCase(
        "zero1_kbit_l1_4bit_alltoall_default_clip",
        stage=1,
        clipping=OPTION_CLIP["max_norm"],
        options={"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    ),
    HybridCase("zero2_1bit_momentum_sync_all", options=_sync_all(2)),
    HybridCase("zero2_1bit_node_size1", node_size=1),
    HybridCase("stage0_1bit", stage=0, node_size=None),
    HybridCase(
        "stage0_1bit_option_clip", stage=0, node_size=None, options={"compression": "1bit", "clip": OPTION_CLIP}
    ),
    HybridCase("zero2_1bit_node_size4", node_size=4),
    # Control without the hybrid: DeepSpeed's own ZeRO-2 over the 4 ranks with exact Lion, which checks
    # the simulation's model of ZeRO (reduction, padding, shards) independently of the hybrid code.
    HybridCase("zero2_exact_control", node_size=None, options={"compression": "none"}),
    HybridCase(
        "zero1_exact_control_accumulation2", stage=1, node_size=None, options={"compression": "none"}, accumulation=2
    ),
    HybridCase(
        "zero2_exact_control_accumulation2", stage=2, node_size=None, options={"compression": "none"}, accumulation=2
    ),
    *EF_CASES,
]
TRAINED_BY_NAME = {case.name: case for case in TRAINED}

# Trained in the main launch but not simulated: bf16 (forward and backward in bf16), with a NaN on one rank.
BF16 = HybridCase("zero2_1bit_bf16_nan_on_one_rank", nan_at=(NAN_RANK, NAN_STEP), extra={"bf16": {"enabled": True}})
# DeepSpeed's norm check off (fp32, no clipping): LionCub's own finite check is the only one, over the world.
FINITE_CHECK_ONLY = HybridCase(
    "zero2_1bit_finite_check_only",
    nan_at=(NAN_RANK, NAN_STEP),
    extra={"zero_optimization": {"compute_grad_norm": False}},
)
# Replica checks every step: the hybrid compares shards across nodes; exact Lion under ZeRO holds
# partitions, not replicas, and must not compare them. Neither may raise.
CONSISTENCY_CHECKED = [
    HybridCase("zero2_1bit_consistency_checked", options={"compression": "1bit", "consistency_check": {"interval": 1}}),
    HybridCase(
        "zero2_exact_consistency_checked",
        node_size=None,
        options={"compression": "none", "consistency_check": {"interval": 1}},
    ),
]
# Option clip under the bf16 wrappers (stage 0: DeepSpeed's unfused fp16/bf16 optimizer; the ZeRO-2 hybrid): LionCub
# clips the unscaled fp32 gradients the wrapper hands it. No simulation: every rank the same factor and parameters.
OPTION_CLIP_BF16 = [
    HybridCase(
        "stage0_1bit_option_clip_bf16",
        stage=0,
        node_size=None,
        options={"compression": "1bit", "clip": OPTION_CLIP},
        extra={"bf16": {"enabled": True}},
    ),
    HybridCase(
        "zero2_1bit_option_clip_bf16",
        options={"compression": "1bit", "clip": OPTION_CLIP},
        extra={"bf16": {"enabled": True}},
    ),
]
UNSIMULATED = [BF16, FINITE_CHECK_ONLY, *CONSISTENCY_CHECKED, *OPTION_CLIP_BF16]

# Saved after CHECKPOINT_AT steps in the main launch, resumed for STEPS - CHECKPOINT_AT more in the second.
CHECKPOINTED = HybridCase("zero2_1bit", stage=2)
# Error feedback's checkpoints: the same, each in its own directory (``ckpt-<name>``); the residual's reset
# clock crosses the resume.
CHECKPOINTED_EF = [EF_RESIDUAL, EF21]
# Loading CHECKPOINTED's files at these node sizes must be refused (the topology changed).
OTHER_TOPOLOGIES = (1, 4)

# Configurations that must be refused before training, with words the message must contain.
REFUSED: dict[str, tuple[HybridCase, tuple[str, ...]]] = {
    "hybrid_at_stage0": (HybridCase("hybrid_at_stage0", stage=0), ("hybrid", "stage 1, 2 or 3")),
    "node_size_not_dividing": (HybridCase("node_size_not_dividing", node_size=3), ("node_size=3", "divide")),
    "optimizer_offload": (
        # DeepSpeed's own refusal of a non-DeepSpeed optimizer with offload is switched off, so LionCub's is reached.
        HybridCase(
            "optimizer_offload",
            extra={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False},
        ),
        ("offload",),
    ),
    "momentum_sync_regexes": (
        HybridCase(
            "momentum_sync_regexes",
            options={"compression": "1bit", "momentum_sync": {"interval": 2, "layers": [r"^2\."]}},
        ),
        ("momentum_sync", "all"),
    ),
    "momentum_sync_auto": (
        HybridCase(
            "momentum_sync_auto", options={"compression": "1bit", "momentum_sync": {"interval": 2, "layers": "auto"}}
        ),
        ("momentum_sync", "all"),
    ),
    "mpi_backend": (
        HybridCase("mpi_backend", options={"compression": "1bit", "comm_backend_name": "mpi"}),
        ("mpi", "hybrid"),
    ),
    "clip_and_gradient_clipping": (
        HybridCase("clip_and_gradient_clipping", clipping=1.0, options={"compression": "1bit", "clip": OPTION_CLIP}),
        ("clip.max_norm (0.7)", "gradient_clipping (1) ask for two different clippings", "gradient_clipping to 0.7"),
    ),
    "clip_exact_under_zero": (
        HybridCase("clip_exact_under_zero", node_size=None, options={"compression": "none", "clip": OPTION_CLIP}),
        ("option clip under ZeRO stage 2", "drop clip and set gradient_clipping"),
    ),
}
