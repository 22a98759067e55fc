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
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

import ds_lioncub  # noqa: F401 - registers LionCub with DeepSpeed
from ds_lioncub.deepspeed_integration import find_lioncub
from tests.support.hybrid_cases import (
    CHECKPOINT_AT,
    CHECKPOINTED,
    CHECKPOINTED_EF,
    OTHER_TOPOLOGIES,
    REFUSED,
    TRAINED,
    UNSIMULATED,
    HybridCase,
    build_model,
    loss_of,
)


def build(case: HybridCase) -> Any:
    model = build_model()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=case.model_parameters(model), config=case.ds_config()
    )
    return engine


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def zero_shards(engine: Any) -> list[torch.Tensor]:
    """The flat fp32 master shards ZeRO-1/2 hands the optimizer, one per param group (none at stage 0)."""
    return list(getattr(engine.optimizer, "single_partition_of_fp32_groups", []))


def optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    """What LionCub steps on this rank: the flat shards under ZeRO, the parameters at stage 0."""
    shards = zero_shards(engine)
    if shards:
        return shards
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    return lioncub._flat_params()


def momenta(engine: Any) -> list[torch.Tensor | None]:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    out = []
    for tensor in optimizer_tensors(engine):
        state = lioncub.state.get(tensor, {})
        out.append(state["exp_avg"].detach().float().clone() if "exp_avg" in state else None)
    return out


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


def lioncub_step(engine: Any) -> int:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    return int(lioncub.param_groups[0]["step"])


def grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


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
        record.setdefault("params", []).append([p.detach().float().clone() for p in engine.module.parameters()])
        record.setdefault("lioncub_step", []).append(lioncub_step(engine))
        record.setdefault("skipped_steps", []).append(int(engine.skipped_steps))
        record.setdefault("grad_norm", []).append(grad_norm(engine))
        stats = lioncub.comm_stats()
        record.setdefault("comm", []).append((stats.collectives, stats.bytes_sent, stats.bytes_received))
        record.setdefault("telemetry", []).append(lioncub.last_step_telemetry)


def final_state(engine: Any, record: dict[str, Any]) -> None:
    record["geometry"] = geometry(engine)
    record["masters"] = [shard.detach().float().clone() for shard in zero_shards(engine)]
    record["momenta"] = momenta(engine)
    record["exp_avg_numel"] = sum(m.numel() for m in record["momenta"] if m is not None)
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    record["aggregation"] = lioncub.aggregation_state()  # error feedback's per-bucket state (None without)


def run_trained() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in [*TRAINED, *UNSIMULATED]:
        record: dict[str, Any] = {"error": None}
        try:
            engine = build(case)
            record["geometry_at_init"] = geometry(engine)
            train(engine, case, 1, case.steps, record)
            final_state(engine, record)
        except Exception as error:  # noqa: BLE001 - recorded; the test reports it
            record["error"] = error_text(error)
            record["traceback"] = traceback.format_exc()
        results[f"trained/{case.name}"] = record
    return results


def save_one(case: HybridCase, directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"error": None}
    try:
        engine = build(case)
        train(engine, case, 1, CHECKPOINT_AT, record)
        engine.save_checkpoint(str(directory))
        final_state(engine, record)
    except Exception as error:  # noqa: BLE001
        record["error"] = error_text(error)
        record["traceback"] = traceback.format_exc()
    return record


def run_save(out: Path) -> dict[str, Any]:
    results = {"save": save_one(CHECKPOINTED, out / "ckpt")}
    for case in CHECKPOINTED_EF:
        results[f"save/{case.name}"] = save_one(case, out / f"ckpt-{case.name}")
    return results


def run_refused() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (case, _) in REFUSED.items():
        try:
            build(case)
            results[f"refused/{name}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"refused/{name}"] = error_text(error)
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


def run_damaged(out: Path) -> dict[str, Any]:
    """The hybrid checkpoint with one side file missing, or truncated, loaded at its own topology: refused."""
    import shutil

    results: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for kind in ("missing", "truncated"):
            target = out / f"damaged-{kind}"
            shutil.copytree(out / "ckpt", target)
            tag = (target / "latest").read_text().strip()
            if kind == "missing":
                (target / tag / "lioncub_hybrid_rank_00002.pt").unlink()
            else:
                path = target / tag / "lioncub_hybrid_rank_00003.pt"
                path.write_bytes(path.read_bytes()[:100])
    dist.barrier()
    for kind in ("missing", "truncated"):
        try:
            build(CHECKPOINTED).load_checkpoint(str(out / f"damaged-{kind}"))
            results[f"damaged/{kind}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"damaged/{kind}"] = error_text(error)
    return results


def resume_one(case: HybridCase, directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"error": None}
    try:
        engine = build(case)
        engine.load_checkpoint(str(directory))
        record["loaded_momenta"] = momenta(engine)
        record["loaded_masters"] = [shard.detach().float().clone() for shard in zero_shards(engine)]
        record["loaded_lioncub_step"] = lioncub_step(engine)
        record["loaded_params"] = [p.detach().float().clone() for p in engine.module.parameters()]
        lioncub = find_lioncub(engine.optimizer)
        assert lioncub is not None
        record["loaded_aggregation"] = lioncub.aggregation_state()
        train(engine, case, CHECKPOINT_AT + 1, case.steps - CHECKPOINT_AT, record)
        final_state(engine, record)
    except Exception as error:  # noqa: BLE001
        record["error"] = error_text(error)
        record["traceback"] = traceback.format_exc()
    return record


def run_resume(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"resume": resume_one(CHECKPOINTED, out / "ckpt")}
    for case in CHECKPOINTED_EF:
        results[f"resume/{case.name}"] = resume_one(case, out / f"ckpt-{case.name}")
    results.update(run_damaged(out))
    for node_size in OTHER_TOPOLOGIES:
        case = dataclasses.replace(CHECKPOINTED, name=f"resume_node_size{node_size}", node_size=node_size)
        try:
            other = build(case)
            other.load_checkpoint(str(out / "ckpt"))
            results[f"resume_at/{node_size}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks the message
            results[f"resume_at/{node_size}"] = error_text(error)
            results[f"resume_at/{node_size}/traceback"] = traceback.format_exc()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("main", "resume"), required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    if args.phase == "main":
        results.update(run_trained())
        results.update(run_save(args.out))
        results.update(run_refused())
        results.update(run_mismatched())
        results.update(run_perturbed())
    else:
        results.update(run_resume(args.out))
    torch.save(results, args.out / f"{args.phase}-rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
