"""One rank of a deepspeed-launched job whose second checkpoint save is interrupted by a rank dying.

Usage (tests/integration/test_interrupted_save.py starts it): deepspeed --num_gpus 2 interrupted_save.py
--out DIR --phase crash|resume. ``crash`` trains 2 steps, saves tag "good", trains 1 more and saves tag
"broken", during which rank 1 dies as its LionCub side file is about to be written (as a killed
process would). ``resume`` loads ``latest`` in a new job and records what it restored.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from ds_lioncub.integration import checkpoint, find_lioncub

CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "LionCub", "params": {"lr": 1e-2, "compression": "1bit"}},
}


def build() -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    return engine


def train(engine: Any, first: int, steps: int) -> None:
    rank = dist.get_rank()
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def momenta(engine: Any) -> list[torch.Tensor]:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    return [m.clone() for m in lioncub.engine_side.local_momentum_state() if m is not None]


def crash(out: Path) -> None:
    engine = build()
    train(engine, 1, 2)
    engine.save_checkpoint(str(out / "ckpt"), tag="good")
    torch.save(momenta(engine), out / f"good-momenta-rank{dist.get_rank()}.pt")
    train(engine, 3, 1)
    if dist.get_rank() == 1:

        def die(*args: Any, **kwargs: Any) -> None:
            os._exit(17)  # no clean-up, no barrier: what a killed rank leaves behind

        checkpoint.save_local_momentum = die  # type: ignore[assignment]
    engine.save_checkpoint(str(out / "ckpt"), tag="broken")
    raise AssertionError("the interrupted save returned")  # rank 0 waits in the barrier until it is killed


def resume(out: Path) -> None:
    engine = build()
    path, _ = engine.load_checkpoint(str(out / "ckpt"))
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    results = {"loaded": path, "momenta": momenta(engine), "lioncub_step": lioncub.param_groups[0]["step"]}
    torch.save(results, out / f"resume-rank{dist.get_rank()}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("crash", "resume"), required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    crash(args.out) if args.phase == "crash" else resume(args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
