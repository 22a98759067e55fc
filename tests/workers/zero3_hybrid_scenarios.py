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
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import traceback
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

import ds_lioncub  # noqa: F401 - registers LionCub with DeepSpeed
from ds_lioncub.deepspeed_integration import find_lioncub
from tests.support.hybrid_cases import CHECKPOINT_AT, OTHER_TOPOLOGIES, HybridCase, build_model, loss_of
from tests.support.zero3_cases import CHECKPOINTED, CHECKPOINTED_EF, REFUSED, TRAINED, UNSIMULATED


def build(case: HybridCase, model: torch.nn.Module | None = None) -> Any:
    model = build_model() if model is None else model
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=case.model_parameters(model), config=case.ds_config()
    )
    return engine


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def gathered_params(engine: Any) -> list[torch.Tensor]:
    """The whole parameters (gathered inside the node), in module order."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def flats(engine: Any) -> list[torch.Tensor]:
    """The flat fp32 tensors ZeRO-3 hands LionCub, one per sub-group."""
    return list(engine.optimizer.fp32_partitioned_groups_flat)


def momenta(engine: Any) -> list[torch.Tensor | None]:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    out = []
    for flat in flats(engine):
        state = lioncub.state.get(flat, {})
        out.append(state["exp_avg"].detach().float().clone() if "exp_avg" in state else None)
    return out


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
        "lioncub_param_groups_between_steps": [len(g["params"]) for g in find_lioncub(zero).param_groups],
        "zero_class": type(zero).__name__,
    }


def lioncub_step(engine: Any) -> int:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    return int(lioncub.param_groups[0]["step"])


def train(engine: Any, case: HybridCase, first_step: int, steps: int, record: dict[str, Any]) -> None:
    rank = dist.get_rank()
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    for step in range(first_step, first_step + steps):
        record.setdefault("lr", []).append(float(engine.get_lr()[0]))
        for micro in range(engine.gradient_accumulation_steps()):
            loss = loss_of(engine, rank, step, micro, case.nan_at)
            engine.backward(loss)
            engine.step()
        record.setdefault("params", []).append(gathered_params(engine))
        record.setdefault("lioncub_step", []).append(lioncub_step(engine))
        record.setdefault("skipped_steps", []).append(int(engine.skipped_steps))
        norm = engine.get_global_grad_norm()
        record.setdefault("grad_norm", []).append(None if norm is None else float(norm))
        stats = lioncub.comm_stats()
        record.setdefault("comm", []).append((stats.collectives, stats.bytes_sent, stats.bytes_received))
        record.setdefault("telemetry", []).append(lioncub.last_step_telemetry)


def final_state(engine: Any, record: dict[str, Any]) -> None:
    record["geometry"] = geometry(engine)
    record["masters"] = [flat.detach().float().clone() for flat in flats(engine)]
    record["momenta"] = momenta(engine)
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    # Every exp_avg LionCub holds on this rank, whatever it is keyed by.
    record["exp_avg_numel"] = sum(state["exp_avg"].numel() for state in lioncub.state.values() if "exp_avg" in state)
    record["aggregation"] = lioncub.aggregation_state()  # error feedback's per-bucket state (None without)


def guarded(record: dict[str, Any], work: Any) -> None:
    try:
        work()
    except Exception as error:  # noqa: BLE001 - recorded; the test reports it
        record["error"] = error_text(error)
        record["traceback"] = traceback.format_exc()


def run_trained(only: set[str] | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in [*TRAINED, *UNSIMULATED]:
        if only and case.name not in only:
            continue
        record: dict[str, Any] = {"error": None}

        def work(case: HybridCase = case, record: dict[str, Any] = record) -> None:
            engine = build(case)
            record["geometry_at_init"] = geometry(engine)
            train(engine, case, 1, case.steps, record)
            final_state(engine, record)

        guarded(record, work)
        results[f"trained/{case.name}"] = record
    return results


def save_one(case: HybridCase, directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"error": None}

    def work() -> None:
        engine = build(case)
        train(engine, case, 1, CHECKPOINT_AT, record)
        engine.save_checkpoint(str(directory))
        final_state(engine, record)

    guarded(record, work)
    return record


def run_save(out: Path) -> dict[str, Any]:
    return {"save": save_one(CHECKPOINTED, out / "ckpt"), "save/ef": save_one(CHECKPOINTED_EF, out / "ckpt-ef")}


def run_refused() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (case, _) in REFUSED.items():
        try:
            model = None
            if name == "world_partitioned":
                with deepspeed.zero.Init(config_dict_or_path=case.ds_config()):
                    model = build_model()
            build(case, model)
            results[f"refused/{name}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"refused/{name}"] = error_text(error)
    return results


def run_damaged(out: Path) -> dict[str, Any]:
    """The checkpoint with one side file missing, loaded at its own topology: refused."""
    results: dict[str, Any] = {}
    if dist.get_rank() == 0:
        target = out / "damaged-missing"
        shutil.copytree(out / "ckpt", target)
        tag = (target / "latest").read_text().strip()
        (target / tag / "lioncub_hybrid_rank_00002.pt").unlink()
    dist.barrier()
    try:
        build(CHECKPOINTED).load_checkpoint(str(out / "damaged-missing"))
        results["damaged/missing"] = None
    except Exception as error:  # noqa: BLE001 - the test checks the message
        results["damaged/missing"] = error_text(error)
    return results


def resume_one(case: HybridCase, directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"error": None}

    def work() -> None:
        engine = build(case)
        engine.load_checkpoint(str(directory))
        record["loaded_momenta"] = momenta(engine)
        record["loaded_masters"] = [flat.detach().float().clone() for flat in flats(engine)]
        record["loaded_lioncub_step"] = lioncub_step(engine)
        lioncub = find_lioncub(engine.optimizer)
        assert lioncub is not None
        record["loaded_aggregation"] = lioncub.aggregation_state()
        train(engine, case, CHECKPOINT_AT + 1, case.steps - CHECKPOINT_AT, record)
        final_state(engine, record)

    guarded(record, work)
    return record


def run_resume(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"resume": resume_one(CHECKPOINTED, out / "ckpt")}
    results["resume/ef"] = resume_one(CHECKPOINTED_EF, out / "ckpt-ef")
    results.update(run_damaged(out))
    others = [(f"node_size{size}", dataclasses.replace(CHECKPOINTED, node_size=size)) for size in OTHER_TOPOLOGIES]
    others.append(("zero2", dataclasses.replace(CHECKPOINTED, stage=2, extra={})))
    for label, case in others:
        try:
            build(case).load_checkpoint(str(out / "ckpt"))
            results[f"resume_at/{label}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"resume_at/{label}"] = error_text(error)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("main", "resume"), required=True)
    parser.add_argument("--only", default="", help="comma-separated trained scenarios (default: all, and the rest)")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    only = {name for name in args.only.split(",") if name} or None
    results: dict[str, Any] = {}
    if args.phase == "main":
        results.update(run_trained(only))
        if only is None:
            results.update(run_save(args.out))
            results.update(run_refused())
    else:
        results.update(run_resume(args.out))
    torch.save(results, args.out / f"{args.phase}-rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
