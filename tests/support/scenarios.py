"""Inputs shared by the multi-process workers and the tests that check their results.

Every input is a pure function of (scenario, rank), so the test process can rebuild what each rank
fed in and compute the expected answer with the brute-force references, independently of the
workers.
"""

from __future__ import annotations

import torch
from torch import Tensor

VOTE_SIZES = (0, 1, 2, 3, 7, 8, 13, 31, 64, 100, 1000, 4099)
STEPS = (1, 2)
KBIT_SIZE = 2053
KBIT_SEGMENTS = (1000, 0, 53, 1000)
LEGACY_SHAPE = (10, 101)
LEGACY_CALLS = 3

PARAM_SHAPES: dict[str, tuple[int, ...]] = {"w1": (40, 64), "b1": (64,), "w2": (64, 8), "b2": (8,)}
TRAIN_STEPS = 6
TRAIN_LR = 0.01
TRAIN_BETAS = (0.9, 0.99)
TRAIN_WEIGHT_DECAY = 0.1
BUCKET_SIZE = 1024  # smaller than w1, so steps cut a tensor across buckets and use several buckets
SYNC_INTERVAL = 2
SYNC_LAYERS = ["^w2$"]
VOTE_STATS = {"telemetry": {"vote_stats": True}}


#: Option clip in the scenarios: a norm below one rank's gradient norm (1.07) and the 2-rank mean's (0.79-0.88),
#: and between the 3- and 4-rank means' (0.56-0.69), so that some of their steps clip and some do not; fewer bins
#: than any tensor but b2 has elements, so that elements collide.
CLIP = {"max_norm": 0.58, "sketch_bins": 257}

# overlap=True against overlap=False on real ranks: (options, accumulation steps, clip norm or None, the rank
# that leaves b2 out of its loss or None, (rank, step) of an inf gradient or None); ranks -1 mean the last.
OVERLAP_CASES: dict[str, tuple[dict[str, object], int, float | None, int | None, tuple[int, int] | None]] = {
    "1bit-clip": ({"compression": "1bit"}, 1, 0.05, None, None),
    "4bit-sign-accumulate-2": ({"compression": "kbit", "bits": 4}, 2, None, None, None),
    "8bit-l1-accumulate-3-unused": ({"compression": "kbit", "bits": 8, "quantizer": "l1"}, 3, None, 0, None),
    "1bit-inf": ({"compression": "1bit"}, 1, None, None, (-1, 3)),
    # Option clip scales the gradients inside step(), after the hooks sent their messages.
    "1bit-option-clip": ({"compression": "1bit", "clip": CLIP}, 1, None, None, None),
}


def loss_without_b2(params: dict[str, Tensor], rank: int, step: int) -> Tensor:
    """:func:`loss_of` without b2: b2 gets no gradient on a rank that uses this loss."""
    x, y = (t.to(params["w1"].device) for t in batch(rank, step))
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] - y) ** 2).mean()


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from ``key`` (scenario number, size, rank, step, ...): inputs are pure functions of it."""
    seed = 0
    for part in key:
        seed = seed * 1_000_003 + part
    return torch.Generator().manual_seed(seed % (2**62))


# gloo collectives cut into segments (TorchTransport.segment_bytes): a segment size that divides none
# of the message sizes, in bytes per destination (all-to-all) and per rank (all-gather).
SEGMENT_BYTES = 7
SEGMENTED_SIZES = (1, 13, 40)
SEGMENTED_KBIT_CASES = (
    {"bits": 4, "quantizer": "sign", "aggregation": "vote", "algorithm": "alltoall"},
    {"bits": 2, "quantizer": "l1", "aggregation": "mean", "algorithm": "alltoall"},
    {"bits": 8, "quantizer": "l1", "aggregation": "vote", "algorithm": "allreduce"},
)


def byte_message(numel: int, rank: int) -> Tensor:
    """Random uint8 bytes: what a rank sends in the segmented-collective scenarios."""
    return torch.randint(0, 256, (numel,), generator=seeded_generator(3, numel, rank), dtype=torch.uint8)


def vote_input(size: int, rank: int, step: int) -> Tensor:
    """Values in {-1, 0, +1}: local zeros and vote ties are common, as the tie rule needs."""
    return torch.randint(-1, 2, (size,), generator=seeded_generator(1, size, rank, step)).float()


def laplace_input(size: int, rank: int, step: int) -> Tensor:
    """A heavy-tailed update, like Lion's pre-sign update, with a few exact zeros."""
    gen = seeded_generator(2, size, rank, step)
    uniform = torch.rand(size, generator=gen, dtype=torch.float64) - 0.5
    values = -torch.sign(uniform) * torch.log1p(-2 * uniform.abs())
    values[torch.rand(size, generator=gen) < 0.02] = 0.0
    return values.float()


# The sum in levels (ds_lioncub.comm.transport.levels): G ranks per node where the world divides evenly.
LEVELLED_SUM_SIZE = 257


def levelled_sum_node_size(world_size: int) -> int:
    return 2 if world_size % 2 == 0 else 1


def levelled_sum_input(rank: int) -> Tensor:
    """fp64 values of magnitudes 1e-8 to 1e8, so that the order of a sum shows in its last bits."""
    gen = seeded_generator(4, rank)
    exponents = torch.randint(-8, 9, (LEVELLED_SUM_SIZE,), generator=gen).double()
    return torch.randn(LEVELLED_SUM_SIZE, generator=gen, dtype=torch.float64) * 10.0**exponents


def legacy_input(rank: int, call: int) -> Tensor:
    return torch.randn(LEGACY_SHAPE, generator=seeded_generator(3, rank, call))


def kbit_cases(world_size: int) -> list[dict[str, object]]:
    """Every k-bit configuration; those too large for the world are expected to raise."""
    cases = []
    for bits in (2, 4, 8):
        for quantizer in ("sign", "l1"):
            for aggregation in ("vote", "mean"):
                for algorithm in ("allreduce", "alltoall"):
                    cases.append(
                        {"bits": bits, "quantizer": quantizer, "aggregation": aggregation, "algorithm": algorithm}
                    )
    return cases


def case_name(case: dict[str, object]) -> str:
    return "-".join(str(v) for v in case.values())


def init_params() -> dict[str, Tensor]:
    gen = seeded_generator(4)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in PARAM_SHAPES.items()}


def batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    gen = seeded_generator(5, rank, step)
    x = torch.randn(16, PARAM_SHAPES["w1"][0], generator=gen)
    y = torch.randn(16, PARAM_SHAPES["w2"][1], generator=gen)
    return x, y


def loss_of(params: dict[str, Tensor], rank: int, step: int) -> Tensor:
    """A two-layer MLP regression loss on this rank's batch for ``step`` (on the parameters' device)."""
    x, y = (t.to(params["w1"].device) for t in batch(rank, step))
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] + params["b2"] - y) ** 2).mean()


def model_grads(params: list[Tensor], rank: int, step: int) -> list[Tensor]:
    """Gradients of :func:`loss_of` for params given in PARAM_SHAPES order (for the references)."""
    with torch.enable_grad():
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        loss = loss_of(dict(zip(PARAM_SHAPES, leaves, strict=True)), rank, step)
        return list(torch.autograd.grad(loss, leaves))


def training_modes(world_size: int) -> dict[str, dict[str, object]]:
    """LionCub options per mode name; k-bit allreduce modes only where the world fits the bits.

    One mode of each way a vote is counted (1-bit, k-bit all-reduce and all-to-all, vote and mean)
    measures the vote statistics (:data:`VOTE_STATS`); the others leave them off.
    """
    modes: dict[str, dict[str, object]] = {
        "none-fp32": {"compression": "none"},
        "none-bf16": {"compression": "none", "comm_dtype": "bf16"},
        "1bit": {"compression": "1bit", **VOTE_STATS},
        "1bit-positive": {"compression": "1bit", "tie_break": "positive"},
        "4bit-sign": {"compression": "kbit", "bits": 4},
        "4bit-sign-mean": {"compression": "kbit", "bits": 4, "aggregation": "mean", **VOTE_STATS},
        "4bit-sign-alltoall": {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall"},
        "8bit-l1": {"compression": "kbit", "bits": 8, "quantizer": "l1", **VOTE_STATS},
        "4bit-l1-alltoall": {
            "compression": "kbit",
            "bits": 4,
            "quantizer": "l1",
            "kbit_algorithm": "alltoall",
            **VOTE_STATS,
        },
        "2bit-l1-alltoall-mean": {
            "compression": "kbit",
            "bits": 2,
            "quantizer": "l1",
            "kbit_algorithm": "alltoall",
            "aggregation": "mean",
            **VOTE_STATS,
        },
        "1bit-sync": {"compression": "1bit", "momentum_sync": {"interval": SYNC_INTERVAL, "layers": SYNC_LAYERS}},
    }
    if world_size <= 3:
        modes["2bit-sign"] = {"compression": "kbit", "bits": 2}
    return modes


def error_feedback_modes(world_size: int) -> dict[str, dict[str, object]]:
    """The error-feedback forms (docs/design.md, section 4.8) the gloo jobs train beside :func:`training_modes`,
    kept apart from them: the brute-force reference of those modes has no error feedback (the EF tests hold
    these to tests/support/error_feedback_reference.py)."""
    l1_alltoall: dict[str, object] = {"compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall"}
    modes: dict[str, dict[str, object]] = {
        "ef-residual-2bit-a2a": {**l1_alltoall, "bits": 2, "error_feedback": {"kind": "residual"}},
        "ef-residual-4bit-a2a-bf16-reset": {
            **l1_alltoall,
            "bits": 4,
            "error_feedback": {
                "kind": "residual",
                "beta": 0.8,
                "reset_interval": 2,
                "storage": "bf16",
                "feed_back": "all",
            },
        },
        "ef-residual-2bit-a2a-mean": {
            **l1_alltoall,
            "bits": 2,
            "aggregation": "mean",
            "error_feedback": {"kind": "residual", "beta": 0.95},
        },
        "ef-residual-2bit-a2a-all": {
            **l1_alltoall,
            "bits": 2,
            "error_feedback": {"kind": "residual", "feed_back": "all"},
        },
        "ef21-2bit": {**l1_alltoall, "bits": 2, "error_feedback": {"kind": "ef21"}},
        "ef21-4bit": {**l1_alltoall, "bits": 4, "error_feedback": {"kind": "ef21"}},
    }
    if world_size <= 7:  # a 4-bit L1 all-reduce holds 7 workers
        modes["ef-residual-4bit-allreduce"] = {
            "compression": "kbit",
            "quantizer": "l1",
            "bits": 4,
            "error_feedback": {"kind": "residual"},
        }
    return modes


def clip_modes(world_size: int) -> dict[str, dict[str, object]]:
    """Option ``clip`` on a sign vote, an L1 all-to-all and exact Lion, trained by the gloo jobs beside
    :func:`training_modes` (the brute-force reference of those modes does not clip: tests/support/clip_reference.py
    does)."""
    return {
        "clip-1bit": {"compression": "1bit", "clip": CLIP},
        "clip-4bit-l1-alltoall": {
            "compression": "kbit",
            "bits": 4,
            "quantizer": "l1",
            "kbit_algorithm": "alltoall",
            "clip": CLIP,
        },
        "clip-none": {"compression": "none", "clip": CLIP},
    }


# The modes whose buckets go through the packed sign vote (and so the fused step kernels where compiled).
SIGN_VOTE_MODES = ("1bit", "1bit-positive", "4bit-sign", "2bit-sign", "1bit-sync")


def simulate_training(world_size: int, steps: int, **options: object) -> tuple[list[Tensor], list[list[Tensor]]]:
    """The brute-force reference (reference.simulate_lioncub) on this module's model, gradients and
    training hyper-parameters: what every rank's LionCub must end with after ``steps`` steps.
    ``options`` may include ``pre_sign_updates`` (a list the simulation appends each step's c to)."""
    from tests.support.reference import simulate_lioncub  # tests only; the workers never need it

    return simulate_lioncub(
        list(init_params().values()),
        lambda rank, step, params: model_grads(params, rank, step),
        world_size,
        steps,
        lr=TRAIN_LR,
        betas=TRAIN_BETAS,
        weight_decay=TRAIN_WEIGHT_DECAY,
        **{"bucket_size": BUCKET_SIZE, **options},  # the optimizers' (scenario_settings): w1's L1 scale spans buckets
    )


def simulate_mode(
    world_size: int, options: dict[str, object], pre_sign_updates: list[list[Tensor]] | None = None
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """:func:`simulate_training` for :data:`TRAIN_STEPS` steps of one of :func:`training_modes`' option sets
    (its LionCub options translated into the reference's arguments; telemetry changes nothing).
    ``pre_sign_updates``: a list that receives every step's per-rank c (compressed modes)."""
    options = dict(options)
    sync = options.pop("momentum_sync", None)
    algorithm = options.pop("kbit_algorithm", "allreduce")
    options.pop("comm_dtype", None)
    options.pop("telemetry", None)
    return simulate_training(
        world_size,
        TRAIN_STEPS,
        kbit_algorithm=algorithm,
        momentum_sync_interval=sync["interval"] if sync else 0,
        momentum_sync_params=[list(PARAM_SHAPES).index("w2")] if sync else None,
        pre_sign_updates=pre_sign_updates,
        **options,
    )
