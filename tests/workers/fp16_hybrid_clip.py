"""One rank of a `deepspeed`-launched job: the default clip under fp16 with a dynamic loss scale of 2^16, under
the ZeRO-1, ZeRO-2 and ZeRO-3 hybrids (2 nodes x 2 ranks), on the CPU.

Usage, from the repository root with it on PYTHONPATH (tests/integration/test_fp16_default_clip.py starts it so):
  deepspeed --num_gpus 4 tests/workers/fp16_hybrid_clip.py --out DIR

DeepSpeed 0.19.8 refuses fp16 on a CPU whose oneDNN lacks fp16 kernels ("Type fp16 is not supported on your
device.", engine._do_sanity_check, from CPU_Accelerator.is_fp16_supported). torch's CPU half arithmetic works,
so this worker overrides that one capability check and nothing else. Each rank saves, per engine and step, the
whole parameters before the step (as fp32), the loss scale the step ran at, DeepSpeed's count of skipped steps,
LionCub's step count and the factor it clipped by; and ZeRO-1/2's shard size.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

import ds_lioncub  # noqa: F401 - registers LionCub with DeepSpeed
from ds_lioncub.integration import find_lioncub

type(get_accelerator()).is_fp16_supported = lambda self: True  # the one override (module docstring)

NODE_SIZE = 2
STEPS = 6
MICRO_BATCH = 4
MAX_NORM = 0.05  # the ds_config's gradient_clipping, which the default clip takes as max_norm
LR = 1e-3
STAGES = (1, 2, 3)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs (as the fp16 model takes them) and targets at ``step``."""
    generator = torch.Generator().manual_seed(1009 * step + rank)
    return torch.randn(MICRO_BATCH, 8, generator=generator).half(), torch.randn(MICRO_BATCH, 3, generator=generator)


def ds_config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every layer gathered, as the ZeRO-3 hybrid tests run it
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": MAX_NORM,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
        "optimizer": {
            "type": "LionCub",
            "params": {"lr": LR, "compression": "1bit", "hybrid": {"node_size": NODE_SIZE}},
        },
    }


def whole_params(engine: Any, stage: int) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().clone() for p in params]
    return [p.detach().float().clone() for p in params]


def train(stage: int) -> dict[str, Any]:
    model = build_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
    lioncub = find_lioncub(engine.optimizer)
    rank = dist.get_rank()
    record: dict[str, Any] = {"steps": []}
    if stage < 3:  # each rank's shard of the flat group, padded at the end to G shards
        record["partition_size"] = [int(size) for size in engine.optimizer.partition_size]
    for step in range(1, STEPS + 1):
        before = whole_params(engine, stage)
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        scale = float(engine.optimizer.loss_scale)
        engine.step()
        record["steps"].append(
            {
                "params": before,
                "loss_scale": scale,
                "skipped": int(engine.skipped_steps),
                "lioncub_step": int(lioncub.param_groups[0]["step"]),
                "factor": lioncub.last_clip_coefficient,
            }
        )
    record["final_params"] = whole_params(engine, stage)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = {f"zero{stage}": train(stage) for stage in STAGES}
    torch.save(results, args.out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
