"""One rank of :mod:`benchmarks.netcluster.silent_node`: LionCub 1-bit steps over gloo until a collective fails.

Started by netcluster in every node's namespace (RANK, WORLD_SIZE, MASTER_ADDR, ... set). It writes
``ready-rank<R>`` into ``--report-dir`` once it has done ``--ready-after`` steps (with the timeout of the
process group its collectives run on) and keeps stepping. When a step raises it writes
``report-rank<R>.json``: when it raised (``time.monotonic()``, one clock for every process of the
machine), the exception's type and message. Then it returns normally, as a script that caught the error
would, so that netcluster does not stop the other ranks before they report too.

``--launch plain``: ``torch.distributed.init_process_group("gloo", timeout=...)`` and
``ds_lioncub.LionCub`` on the default group. ``--launch deepspeed``: ``deepspeed.init_distributed(
timeout=...)`` and ``deepspeed.initialize`` with ``"type": "LionCub"`` (ZeRO stage 0): LionCub then runs
on the engine's data-parallel group, which DeepSpeed creates with ``new_group`` (torch's default
timeout); ``--set-group-timeout`` sets the timeout on that group too, as docs/user-guide.md advises.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_lioncub import LionCub
from ds_lioncub.comm.transport.torch_dist import process_group_timeout


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))


def _plain(args: argparse.Namespace, timeout: timedelta | None) -> tuple[Any, dist.ProcessGroup | None]:
    """A step function over LionCub on the default group, and that group (None)."""
    if timeout is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=timeout)
    model = _model(args.width)
    optimizer = LionCub(model.parameters(), lr=1e-4, compression="1bit")

    def step(batch: torch.Tensor) -> None:
        loss = (model(batch) - batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step, None


def _deepspeed(args: argparse.Namespace, timeout: timedelta | None) -> tuple[Any, dist.ProcessGroup | None]:
    """A step function over a DeepSpeed engine with LionCub, and the group LionCub runs on."""
    import deepspeed

    if timeout is None:
        deepspeed.init_distributed("gloo", verbose=False)
    else:
        deepspeed.init_distributed("gloo", timeout=timeout, verbose=False)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "LionCub", "params": {"lr": 1e-4, "compression": "1bit"}},
        "steps_per_print": 10**9,
    }
    model = _model(args.width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    group = engine.seq_data_parallel_group
    if args.set_group_timeout and timeout is not None:
        group.set_timeout(timeout)

    def step(batch: torch.Tensor) -> None:
        loss = (engine(batch) - batch).pow(2).mean()
        engine.backward(loss)
        engine.step()

    return step, group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=None, help="process group timeout in s (default: torch's)")
    parser.add_argument("--launch", choices=("plain", "deepspeed"), default="plain")
    parser.add_argument("--set-group-timeout", action="store_true", help="deepspeed: also on the engine's group")
    parser.add_argument("--ready-after", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    timeout = None if args.timeout is None else timedelta(seconds=args.timeout)
    set_up = _deepspeed if args.launch == "deepspeed" else _plain
    step, group = set_up(args, timeout)
    group_timeout = process_group_timeout(group)
    generator = torch.Generator().manual_seed(rank)
    done = 0
    report: dict[str, Any] = {"rank": rank, "group_timeout_s": group_timeout and group_timeout.total_seconds()}
    try:
        while done < args.max_steps:
            step(torch.randn(args.batch, args.width, generator=generator))
            done += 1
            if done == args.ready_after:
                (args.report_dir / f"ready-rank{rank}").write_text(json.dumps(report) + "\n")
        report.update(raised_at=None, steps=done)
    except Exception as error:  # noqa: BLE001 - any error a collective raises is what is measured
        report.update(
            raised_at=time.monotonic(), steps=done, error_type=type(error).__name__, message=str(error).strip()
        )
    partial = args.report_dir / f".report-rank{rank}.json"
    partial.write_text(json.dumps(report) + "\n")
    partial.rename(args.report_dir / f"report-rank{rank}.json")  # the harness never reads half a report


if __name__ == "__main__":
    main()
