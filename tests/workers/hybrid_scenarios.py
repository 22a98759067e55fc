"""One rank of a `deepspeed`-launched job that trains compressed LionCub under ZeRO-1/2 as a hybrid.

Usage, from the repository root with it on PYTHONPATH (tests.support.launch.run_deepspeed starts it so):
  deepspeed --num_gpus 4 tests/workers/hybrid_scenarios.py --out DIR --phase main|resume

``main`` trains every scenario of tests.support.hybrid_cases.TRAINED with a fresh engine, saves a
checkpoint of CHECKPOINTED and of each of CHECKPOINTED_EF after CHECKPOINT_AT steps, and builds every
REFUSED configuration; ``resume`` (a new job) loads those checkpoints, trains the remaining steps, and
tries to load CHECKPOINTED's at other node sizes. A scenario that raises records its error and the job
goes on with the next one. Each rank saves what it saw (parameters after every step, its shards of the
master weights and of the momentum, its error-feedback state, the partition geometry ZeRO chose, step
counts, learning rates, LionCub's traffic and per-step telemetry, error messages) to
DIR/<phase>-rank<R>.pt; tests/integration/test_zero_hybrid.py compares them with the simulation.
How a case is built, trained, recorded, saved and resumed is tests.support.hybrid_worker's (shared with
the ZeRO-3 worker); this file names where ZeRO-1/2 keeps the tensors (VIEW) and its own scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from tests.support.hybrid_cases import (
    CHECKPOINTED,
    CHECKPOINTED_EF,
    OTHER_TOPOLOGIES,
    REFUSED,
    TRAINED,
    UNSIMULATED,
    HybridCase,
    loss_of,
)
from tests.support.hybrid_worker import (
    ZeroView,
    attempt,
    build,
    error_text,
    lioncub_of,
    run_damaged,
    run_resumed,
    run_save,
    run_trained,
    run_worker,
)


def zero_shards(engine: Any) -> list[torch.Tensor]:
    """The flat fp32 master shards ZeRO-1/2 hands the optimizer, one per param group (none at stage 0)."""
    return list(getattr(engine.optimizer, "single_partition_of_fp32_groups", []))


def optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    """What LionCub steps on this rank: the flat shards under ZeRO, the parameters at stage 0."""
    shards = zero_shards(engine)
    if shards:
        return shards
    return lioncub_of(engine)._flat_params()


def geometry(engine: Any) -> dict[str, Any] | None:
    """The partition ZeRO actually uses: shard sizes, padding, which parameters each group holds, its group."""
    zero = engine.optimizer
    if not hasattr(zero, "single_partition_of_fp32_groups"):
        return None
    index = {id(p): i for i, p in enumerate(engine.module.parameters())}
    return {
        "partition_size": [int(size) for size in zero.partition_size],
        "groups_padding": [int(pad) for pad in zero.groups_padding],
        "param_padding": [[int(pad) for pad in pads] for pads in zero.round_robin_bit16_padding],
        "partition_numel": [shard.numel() for shard in zero.single_partition_of_fp32_groups],
        "groups": [[index[id(p)] for p in group] for group in zero.bit16_groups],
        "zero_group_ranks": dist.get_process_group_ranks(zero.dp_process_group),
        "engine_dp_world_size": int(engine.dp_world_size),
    }


def module_params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def momentum_numel(engine: Any, momenta: list[torch.Tensor | None]) -> int:
    return sum(m.numel() for m in momenta if m is not None)


VIEW = ZeroView(
    params=module_params,
    masters=zero_shards,
    stepped=optimizer_tensors,
    geometry=geometry,
    exp_avg_numel=momentum_numel,
    loaded_params=True,
)
EF_CHECKPOINTS = {case.name: case for case in CHECKPOINTED_EF}


def run_refused() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (case, _) in REFUSED.items():
        attempt(results, f"refused/{name}", lambda case=case: build(case))
    return results


def run_perturbed() -> dict[str, Any]:
    """Replica check every 2 steps; rank 3's master shard is changed after step 2: every rank must raise at 4."""
    rank = dist.get_rank()
    case = HybridCase("perturbed", options={"compression": "1bit", "consistency_check": {"interval": 2}})
    engine = build(case)
    try:
        for step in range(1, 5):
            engine.backward(loss_of(engine, rank, step, 0, None))
            engine.step()
            if step == 2 and rank == 3:
                with torch.no_grad():
                    engine.optimizer.single_partition_of_fp32_groups[0][0] += 1.0
        return {"perturbed": None}
    except Exception as error:  # noqa: BLE001 - the test checks the message
        return {"perturbed": error_text(error)}


def run_mismatched() -> dict[str, Any]:
    """Rank 1 built differently from the others: every rank must raise the same error, without a hang."""
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    stage0 = HybridCase("mismatched", stage=0, node_size=None)
    for name, options, hidden in (
        ("options", {"compression": "kbit"} if rank == 1 else {"compression": "1bit"}, 16),
        ("model", {"compression": "1bit"}, 12 if rank == 1 else 16),
    ):
        case = dataclasses.replace(stage0, options=options)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=case.ds_config())
            results[f"mismatch/{name}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"mismatch/{name}"] = error_text(error)
    return results


def run_main(args: argparse.Namespace) -> dict[str, Any]:
    results = run_trained([*TRAINED, *UNSIMULATED], VIEW)
    results.update(run_save(args.out, CHECKPOINTED, EF_CHECKPOINTS, VIEW))
    results.update(run_refused())
    results.update(run_mismatched())
    results.update(run_perturbed())
    return results


def run_resume(args: argparse.Namespace) -> dict[str, Any]:
    results = run_resumed(args.out, CHECKPOINTED, EF_CHECKPOINTS, VIEW)
    results.update(run_damaged(args.out, CHECKPOINTED, ("missing", "truncated")))
    for node_size in OTHER_TOPOLOGIES:
        case = dataclasses.replace(CHECKPOINTED, name=f"resume_node_size{node_size}", node_size=node_size)
        attempt(
            results,
            f"resume_at/{node_size}",
            lambda case=case: build(case).load_checkpoint(str(args.out / "ckpt")),
            with_traceback=True,
        )
    return results


if __name__ == "__main__":
    run_worker(run_main, run_resume)
