"""One rank of a `deepspeed`-launched job that trains compressed LionCub under ZeRO-3 as a hybrid.

Usage, from the repository root with it on PYTHONPATH (tests.support.launch.run_deepspeed starts it so):
  deepspeed --num_gpus 4 tests/workers/zero3_hybrid_scenarios.py --out DIR --phase main|resume [--only NAME,...]

``main`` trains every scenario of tests.support.zero3_cases.TRAINED and UNSIMULATED with a fresh engine,
saves a checkpoint of CHECKPOINTED and of CHECKPOINTED_EF after CHECKPOINT_AT steps and builds every REFUSED
configuration; ``resume`` (a new job) loads those checkpoints, trains the remaining steps, and tries to load
CHECKPOINTED's at other node sizes and damaged. A scenario that raises records its error and the job goes on.
Each rank saves what it saw (the gathered parameters after every step, its flat master and momentum tensors,
its error-feedback state, the sub-groups and partition ZeRO-3 chose, step counts, learning rates, traffic and
telemetry, error messages) to DIR/<phase>-rank<R>.pt.
How a case is built, trained, recorded, saved and resumed is tests.support.hybrid_worker's (shared with
the ZeRO-1/2 worker); this file names where ZeRO-3 keeps the tensors (VIEW) and its own scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from tests.support.hybrid_cases import OTHER_TOPOLOGIES, build_model
from tests.support.hybrid_worker import (
    ZeroView,
    attempt,
    build,
    lioncub_of,
    run_damaged,
    run_resumed,
    run_save,
    run_trained,
    run_worker,
)
from tests.support.zero3_cases import CHECKPOINTED, CHECKPOINTED_EF, REFUSED, TRAINED, UNSIMULATED


def gathered_params(engine: Any) -> list[torch.Tensor]:
    """The whole parameters (gathered inside the node), in module order."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def flats(engine: Any) -> list[torch.Tensor]:
    """The flat fp32 tensors ZeRO-3 hands LionCub, one per sub-group."""
    return list(engine.optimizer.fp32_partitioned_groups_flat)


def geometry(engine: Any) -> dict[str, Any]:
    """The partition ZeRO-3 uses: sub-groups (parameter indices), their param groups and flat sizes, groups."""
    zero = engine.optimizer
    index = {id(p): i for i, p in enumerate(engine.module.parameters())}
    return {
        "sub_groups": [[index[id(p)] for p in group] for group in zero.fp16_groups],
        "sub_group_param_group": [int(zero.sub_group_to_group_id[i]) for i in range(len(zero.fp16_groups))],
        "flat_numel": [flat.numel() for flat in flats(engine)],
        "slice_numel": [int(p.partition_numel()) for p in engine.module.parameters()],
        "zero_group_ranks": dist.get_process_group_ranks(zero.dp_process_group),
        "param_group_ranks": [
            sorted(dist.get_process_group_ranks(p.ds_process_group)) for p in engine.module.parameters()
        ],
        "engine_dp_world_size": int(engine.dp_world_size),
        "lioncub_param_groups_between_steps": [len(g["params"]) for g in lioncub_of(engine).param_groups],
        "zero_class": type(zero).__name__,
    }


def held_exp_avg_numel(engine: Any, momenta: list[torch.Tensor | None]) -> int:
    """Every exp_avg LionCub holds on this rank, whatever it is keyed by (not only the flats' momenta)."""
    lioncub = lioncub_of(engine)
    return sum(state["exp_avg"].numel() for state in lioncub.state.values() if "exp_avg" in state)


VIEW = ZeroView(
    params=gathered_params, masters=flats, stepped=flats, geometry=geometry, exp_avg_numel=held_exp_avg_numel
)
EF_CHECKPOINTS = {"ef": CHECKPOINTED_EF}


def run_refused() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (case, _) in REFUSED.items():

        def refused(name: str = name, case: Any = case) -> None:
            model = None
            if name == "world_partitioned":
                with deepspeed.zero.Init(config_dict_or_path=case.ds_config()):
                    model = build_model()
            build(case, model)

        attempt(results, f"refused/{name}", refused)
    return results


def run_main(args: argparse.Namespace) -> dict[str, Any]:
    only = {name for name in args.only.split(",") if name} or None
    results = run_trained([*TRAINED, *UNSIMULATED], VIEW, only)
    if only is None:
        results.update(run_save(args.out, CHECKPOINTED, EF_CHECKPOINTS, VIEW))
        results.update(run_refused())
    return results


def run_resume(args: argparse.Namespace) -> dict[str, Any]:
    results = run_resumed(args.out, CHECKPOINTED, EF_CHECKPOINTS, VIEW)
    results.update(run_damaged(args.out, CHECKPOINTED, ("missing",)))
    others = [(f"node_size{size}", dataclasses.replace(CHECKPOINTED, node_size=size)) for size in OTHER_TOPOLOGIES]
    others.append(("zero2", dataclasses.replace(CHECKPOINTED, stage=2, extra={})))
    for label, case in others:
        attempt(results, f"resume_at/{label}", lambda case=case: build(case).load_checkpoint(str(args.out / "ckpt")))
    return results


def add_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", help="comma-separated trained scenarios (default: all, and the rest)")


if __name__ == "__main__":
    run_worker(run_main, run_resume, add_only)
