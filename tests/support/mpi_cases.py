"""Inputs of the MPI-transport jobs (tests/workers/mpi_scenarios.py), shared with tests/integration/test_mpi.py.

Every input is a pure function of (case, rank), so the test process can rebuild what each rank sent.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tests.support import scenarios as sc

# torch.int16 is left out: gloo cannot sum it (the MPI transport can).
DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ALL_TO_ALL_CHUNKS = (1, 37, 1000)  # elements each rank sends to each rank
ALL_GATHER_SIZES = (1, 5, 1003)
ALL_REDUCE_SIZES = (1, 5, 1003, 4099)

ENGINE_STEPS = 6
ENGINE_OPTIONS = {"compression": "1bit", "comm_backend_name": "mpi", "bucket_size": sc.BUCKET_SIZE}


def transport_input(kind: int, dtype_name: str, size: int, rank: int) -> Tensor:
    """Floats spread over seven decades (so the summation order shows in the last bits); integers
    spanning their type (uint8 sums of three ranks wrap, as gloo's do)."""
    dtype = DTYPES[dtype_name]
    gen = sc.seeded_generator(7, kind, list(DTYPES).index(dtype_name), size, rank)
    if dtype.is_floating_point:
        scale = 10.0 ** torch.randint(-3, 4, (size,), generator=gen).double()
        return (torch.randn(size, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (size,), generator=gen).to(dtype)
    return torch.randint(-(10**6), 10**6, (size,), generator=gen).to(dtype)


def rank_order_sum(inputs: list[Tensor]) -> Tensor:
    """((x0 + x1) + x2) + ..., accumulated in fp32 for fp16/bf16 and rounded once: what the MPI transport
    promises for floating-point sums."""
    dtype = inputs[0].dtype
    if not dtype.is_floating_point:
        total = inputs[0].long().clone()
        for x in inputs[1:]:
            total += x.long()
        return total.to(dtype) if dtype != torch.uint8 else (total % 256).to(dtype)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    total = inputs[0].to(accumulate, copy=True)
    for x in inputs[1:]:
        total += x.to(accumulate)
    return total.to(dtype)


class Mlp(nn.Module):
    """tests/support/scenarios.py's two-layer MLP as a module, so the DeepSpeed engine can train it."""

    def __init__(self) -> None:
        super().__init__()
        for name, value in sc.init_params().items():
            self.register_parameter(name, nn.Parameter(value.clone()))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        hidden = torch.tanh(x @ self.w1 + self.b1)
        return ((hidden @ self.w2 + self.b2 - y) ** 2).mean()


def engine_config() -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 clips at 1.0 by default; the simulation does not clip
        "optimizer": {
            "type": "LionCub",
            "params": {
                "lr": sc.TRAIN_LR,
                "betas": list(sc.TRAIN_BETAS),
                "weight_decay": sc.TRAIN_WEIGHT_DECAY,
                **ENGINE_OPTIONS,
            },
        },
    }
