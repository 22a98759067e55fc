"""What the two ZeRO hybrid workers share: building, training, recording, checkpointing and resuming a case.

tests/workers/hybrid_scenarios.py (ZeRO-1/2) and tests/workers/zero3_hybrid_scenarios.py (ZeRO-3) run their
scenarios (tests.support.hybrid_cases, tests.support.zero3_cases) the same way on every rank and record the
same keys; they differ only in where ZeRO keeps the tensors LionCub steps and how the whole parameters are
read, which each worker names in a ZeroView. A scenario that raises records its error (and traceback) and
the job goes on with the next one, so one launch reports every scenario.
"""

from __future__ import annotations

import argparse
import shutil
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import Tensor

import ds_lioncub  # noqa: F401 - registers LionCub with DeepSpeed
from ds_lioncub import LionCub
from ds_lioncub.integration import find_lioncub
from tests.support.hybrid_cases import CHECKPOINT_AT, HybridCase, build_model, loss_of

Record = dict[str, Any]
Phase = Callable[[argparse.Namespace], dict[str, Any]]


@dataclass(frozen=True)
class ZeroView:
    """Where one ZeRO stage keeps what a worker records (each a function of the engine)."""

    params: Callable[[Any], list[Tensor]]  # the whole parameters, in module order, as float copies
    masters: Callable[[Any], list[Tensor]]  # the flat fp32 master tensors this rank holds
    stepped: Callable[[Any], list[Tensor]]  # the tensors LionCub steps, whose state holds the momenta
    geometry: Callable[[Any], dict[str, Any] | None]  # the partition ZeRO chose
    exp_avg_numel: Callable[[Any, list[Tensor | None]], int]  # momentum elements this rank keeps
    loaded_params: bool = False  # record the whole parameters right after a checkpoint is loaded


def build(case: HybridCase, model: torch.nn.Module | None = None) -> Any:
    """A DeepSpeed engine for ``case``, on ``model`` or a fresh tests.support.hybrid_cases model."""
    model = build_model() if model is None else model
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=case.model_parameters(model), config=case.ds_config()
    )
    return engine


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def guarded(record: Record, work: Callable[[], None]) -> None:
    """Run ``work``; an error it raises goes into ``record`` (the test reports it) instead of ending the job."""
    try:
        work()
    except Exception as error:  # noqa: BLE001 - recorded; the test reports it
        record["error"] = error_text(error)
        record["traceback"] = traceback.format_exc()


def attempt(results: dict[str, Any], key: str, work: Callable[[], object], with_traceback: bool = False) -> None:
    """``results[key]``: None when ``work`` ran, else its error (the test checks the message)."""
    try:
        work()
        results[key] = None
    except Exception as error:  # noqa: BLE001 - the test checks the message
        results[key] = error_text(error)
        if with_traceback:
            results[f"{key}/traceback"] = traceback.format_exc()


def lioncub_of(engine: Any) -> LionCub:
    lioncub = find_lioncub(engine.optimizer)
    assert lioncub is not None
    return lioncub


def lioncub_step(engine: Any) -> int:
    return int(lioncub_of(engine).param_groups[0]["step"])


def momenta(engine: Any, view: ZeroView) -> list[Tensor | None]:
    """Each stepped tensor's momentum on this rank (None where LionCub holds none yet)."""
    lioncub = lioncub_of(engine)
    out = []
    for tensor in view.stepped(engine):
        state = lioncub.state.get(tensor, {})
        out.append(state["exp_avg"].detach().float().clone() if "exp_avg" in state else None)
    return out


def masters(engine: Any, view: ZeroView) -> list[Tensor]:
    return [tensor.detach().float().clone() for tensor in view.masters(engine)]


def train(engine: Any, case: HybridCase, first_step: int, steps: int, record: Record, view: ZeroView) -> None:
    """Optimizer steps ``first_step`` on; after each, what every rank must agree on with the simulation."""
    rank = dist.get_rank()
    lioncub = lioncub_of(engine)
    for step in range(first_step, first_step + steps):
        record.setdefault("lr", []).append(float(engine.get_lr()[0]))
        for micro in range(engine.gradient_accumulation_steps()):
            loss = loss_of(engine, rank, step, micro, case.nan_at)
            engine.backward(loss)
            engine.step()
        record.setdefault("params", []).append(view.params(engine))
        record.setdefault("lioncub_step", []).append(lioncub_step(engine))
        record.setdefault("skipped_steps", []).append(int(engine.skipped_steps))
        norm = engine.get_global_grad_norm()
        record.setdefault("grad_norm", []).append(None if norm is None else float(norm))
        stats = lioncub.comm_stats()
        record.setdefault("comm", []).append((stats.collectives, stats.bytes_sent, stats.bytes_received))
        record.setdefault("telemetry", []).append(lioncub.last_step_telemetry)
        record.setdefault("clip_factor", []).append(lioncub.last_clip_coefficient)


def final_state(engine: Any, record: Record, view: ZeroView) -> None:
    record["geometry"] = view.geometry(engine)
    record["masters"] = masters(engine, view)
    record["momenta"] = momenta(engine, view)
    record["exp_avg_numel"] = view.exp_avg_numel(engine, record["momenta"])
    record["aggregation"] = lioncub_of(engine).engine_side.aggregation_state()  # error feedback's state (None without)


def run_trained(cases: list[HybridCase], view: ZeroView, only: set[str] | None = None) -> dict[str, Any]:
    """Every case (or those named in ``only``) trained for its steps with a fresh engine: ``trained/<name>``."""
    results: dict[str, Any] = {}
    for case in cases:
        if only and case.name not in only:
            continue
        record: Record = {"error": None}

        def work(case: HybridCase = case, record: Record = record) -> None:
            engine = build(case)
            record["geometry_at_init"] = view.geometry(engine)
            train(engine, case, 1, case.steps, record, view)
            final_state(engine, record, view)

        guarded(record, work)
        results[f"trained/{case.name}"] = record
    return results


def save_one(case: HybridCase, directory: Path, view: ZeroView) -> Record:
    """``case`` trained CHECKPOINT_AT steps, then checkpointed into ``directory``."""
    record: Record = {"error": None}

    def work() -> None:
        engine = build(case)
        train(engine, case, 1, CHECKPOINT_AT, record, view)
        engine.save_checkpoint(str(directory))
        final_state(engine, record, view)

    guarded(record, work)
    return record


def run_save(out: Path, checkpointed: HybridCase, labelled: Mapping[str, HybridCase], view: ZeroView) -> dict[str, Any]:
    """``checkpointed`` saved to ``out/ckpt`` (``save``), each labelled case to ``out/ckpt-<label>``."""
    results = {"save": save_one(checkpointed, out / "ckpt", view)}
    for label, case in labelled.items():
        results[f"save/{label}"] = save_one(case, out / f"ckpt-{label}", view)
    return results


def resume_one(case: HybridCase, directory: Path, view: ZeroView) -> Record:
    """A fresh engine for ``case`` loads ``directory``: what it loaded, then the steps after CHECKPOINT_AT."""
    record: Record = {"error": None}

    def work() -> None:
        engine = build(case)
        engine.load_checkpoint(str(directory))
        record["loaded_momenta"] = momenta(engine, view)
        record["loaded_masters"] = masters(engine, view)
        record["loaded_lioncub_step"] = lioncub_step(engine)
        if view.loaded_params:
            record["loaded_params"] = view.params(engine)
        record["loaded_aggregation"] = lioncub_of(engine).engine_side.aggregation_state()
        train(engine, case, CHECKPOINT_AT + 1, case.steps - CHECKPOINT_AT, record, view)
        final_state(engine, record, view)

    guarded(record, work)
    return record


def run_resumed(
    out: Path, checkpointed: HybridCase, labelled: Mapping[str, HybridCase], view: ZeroView
) -> dict[str, Any]:
    """run_save's checkpoints resumed in this (new) job: ``resume`` and ``resume/<label>``."""
    results = {"resume": resume_one(checkpointed, out / "ckpt", view)}
    for label, case in labelled.items():
        results[f"resume/{label}"] = resume_one(case, out / f"ckpt-{label}", view)
    return results


def run_damaged(out: Path, checkpointed: HybridCase, kinds: tuple[str, ...]) -> dict[str, Any]:
    """``out/ckpt`` with rank 2's side file missing, or rank 3's truncated, loaded at its own topology."""
    results: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for kind in kinds:
            target = out / f"damaged-{kind}"
            shutil.copytree(out / "ckpt", target)
            tag = (target / "latest").read_text().strip()
            if kind == "missing":
                (target / tag / "lioncub_hybrid_rank_00002.pt").unlink()
            else:
                path = target / tag / "lioncub_hybrid_rank_00003.pt"
                path.write_bytes(path.read_bytes()[:100])
    dist.barrier()
    for kind in kinds:
        attempt(
            results,
            f"damaged/{kind}",
            lambda kind=kind: build(checkpointed).load_checkpoint(str(out / f"damaged-{kind}")),
        )
    return results


def run_worker(
    main_phase: Phase, resume_phase: Phase, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> None:
    """Parse the launcher's arguments, join the gloo world, run the phase and save this rank's results to
    ``<out>/<phase>-rank<R>.pt`` (where tests.support.launch.run_main_and_resume reads them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("main", "resume"), required=True)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = main_phase(args) if args.phase == "main" else resume_phase(args)
    torch.save(results, args.out / f"{args.phase}-rank{dist.get_rank()}.pt")
    dist.barrier()
