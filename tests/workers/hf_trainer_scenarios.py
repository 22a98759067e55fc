"""One rank of a `deepspeed`-launched job that trains a Hugging Face model with ``transformers.Trainer`` and a
ds_config whose optimizer is compressed LionCub under the ZeRO hybrid (tests.support.hf_cases).

Usage, from the repository root with it on PYTHONPATH (tests.support.launch.run_deepspeed starts it so):
  deepspeed --num_gpus 4 tests/workers/hf_trainer_scenarios.py --out DIR

Each case of tests.support.hf_cases.CASES gets a fresh model, TrainingArguments and Trainer and runs
``trainer.train()`` as a user would: the Trainer builds the DeepSpeed engine from the ds_config (LionCub from
its "optimizer" block, the Trainer's linear lr schedule on it). Then the model is built the way the HF docs
show for ZeRO-3 (``from_config`` after the TrainingArguments, so under DeepSpeed's ``zero.Init``), which the
hybrid must refuse. A case that raises records its error and the job goes on. Each rank saves what it saw
(every batch its model got, the gathered parameters and the lr after every step, the engine's optimizer,
LionCub's groups and state sizes, the Trainer's logged losses, error messages) to DIR/rank<R>.pt.
"""

from __future__ import annotations

import argparse
import os
import traceback
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import ds_lioncub  # noqa: F401 - registers LionCub with DeepSpeed
from ds_lioncub.integration import find_lioncub
from ds_lioncub.integration.hybrid_zero import ENGINE_ATTRIBUTE
from tests.support.hf_cases import (
    BETAS,
    CASES,
    LR,
    MICRO_BATCH,
    STEPS,
    WEIGHT_DECAY,
    CountingDataset,
    HfCase,
    build_model,
    model_config,
)


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def arguments(case: HfCase, out: Path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out / case.name),
        deepspeed=case.ds_config(),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=0.0,  # no clipping: the simulation's bitwise path
        # Each rank's loss is its own batch's mean (the hybrid's semantics); the default would rescale it by
        # the world's token count, the same gradient up to rounding.
        average_tokens_across_devices=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        # The distributed state set up by distributed_state_on_cpu, not one the Trainer makes itself.
        accelerator_config={"use_configured_state": True},
    )


def distributed_state_on_cpu() -> None:
    """Set up accelerate's distributed state for DeepSpeed over gloo, before any TrainingArguments.

    On a machine without a GPU, the TrainingArguments of a DeepSpeed run (transformers 5.24, accelerate 1.15)
    make accelerate's state with no process-group backend, and accelerate then counts one process of rank 0 on
    every rank: the Trainer fills train_batch_size for a world of 1 and DeepSpeed refuses it. Made here with
    backend "gloo" (and DeepSpeed selected, as the TrainingArguments do), the state counts the 4 ranks; the
    TrainingArguments use it (``use_configured_state``).
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def gathered(model: torch.nn.Module) -> list[torch.Tensor]:
    """The whole parameters in module order (ZeRO-3 gathers them inside the node; a no-op at stage 2)."""
    params = list(model.parameters())
    if not hasattr(params[0], "ds_id"):
        return [p.detach().float().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


class Recorder(TrainerCallback):
    """After every optimizer step: the gathered parameters, the lr LionCub stepped with, LionCub's step."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.trainer: Trainer | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        engine = self.trainer.model_wrapped
        lioncub = find_lioncub(engine.optimizer)
        assert lioncub is not None
        self.record.setdefault("params", []).append(gathered(self.trainer.model))
        self.record.setdefault("lioncub_step", []).append(int(lioncub.param_groups[0]["step"]))
        self.record.setdefault("skipped_steps", []).append(int(engine.skipped_steps))
        self.record.setdefault("global_step", []).append(int(state.global_step))


def record_batches(model: torch.nn.Module, record: dict[str, Any]) -> None:
    """Every call of the model: the keyword arguments the Trainer passed (the batch, ``num_items_in_batch``) and
    the loss it returned, so the test can recompute each rank's gradient without the Trainer."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        assert not args, "the Trainer calls the model with keyword arguments"
        kept = {key: value.detach().clone() if torch.is_tensor(value) else value for key, value in kwargs.items()}
        record.setdefault("calls", []).append(kept)
        record.setdefault("losses", []).append(float(output.loss))

    model.register_forward_hook(hook, with_kwargs=True)


def engine_facts(trainer: Trainer) -> dict[str, Any]:
    """What the Trainer built: the engine's optimizer, LionCub's groups, and how much state each rank keeps."""
    engine = trainer.model_wrapped
    zero = engine.optimizer
    lioncub = find_lioncub(zero)
    assert lioncub is not None
    setup = getattr(engine, ENGINE_ATTRIBUTE, None)
    index = {id(p): i for i, p in enumerate(trainer.model.parameters())}
    facts: dict[str, Any] = {
        "engine_class": type(engine).__name__,
        "zero_class": type(zero).__name__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "lioncub_class": type(lioncub).__name__,
        "compression": lioncub.options.compression,
        "transport_world_size": int(lioncub.transport.world_size),
        "transport_rank": int(lioncub.transport.rank),
        "engine_dp_world_size": int(engine.dp_world_size),
        "zero_group_ranks": dist.get_process_group_ranks(zero.dp_process_group),
        "vote_group_ranks": None if setup is None else dist.get_process_group_ranks(setup.groups.vote_group),
        "exp_avg_numel": sum(state["exp_avg"].numel() for state in lioncub.state.values() if "exp_avg" in state),
        "lioncub_lr": [float(group["lr"]) for group in lioncub.param_groups],
        "lioncub_weight_decay": [float(group["weight_decay"]) for group in lioncub.param_groups],
        "lioncub_betas": [tuple(group["betas"]) for group in lioncub.param_groups],
    }
    if facts["zero_stage"] == 3:
        facts["sub_groups"] = [[index[id(p)] for p in group] for group in zero.fp16_groups]
        facts["slice_numel"] = [int(p.partition_numel()) for p in trainer.model.parameters()]
        facts["param_group_ranks"] = [
            sorted(dist.get_process_group_ranks(p.ds_process_group)) for p in trainer.model.parameters()
        ]
    return facts


def run_case(case: HfCase, out: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"error": None}
    try:
        model = build_model()  # before the TrainingArguments: a plain model, which the hybrid partitions
        record["initial"] = [p.detach().clone() for p in model.parameters()]
        record_batches(model, record)
        recorder = Recorder(record)
        trainer = Trainer(model=model, args=arguments(case, out), train_dataset=CountingDataset(), callbacks=[recorder])
        recorder.trainer = trainer
        result = trainer.train()
        record["train_loss"] = float(result.training_loss)
        record["log_history"] = list(trainer.state.log_history)
        record.update(engine_facts(trainer))
        record["world_size_seen_by_trainer"] = int(trainer.args.world_size)
        record["process_index_seen_by_trainer"] = int(trainer.args.process_index)
    except Exception as error:  # noqa: BLE001 - recorded; the test reports it
        record["error"] = error_text(error)
        record["traceback"] = traceback.format_exc()
    return record


def run_partitioned_by_hf(case: HfCase, out: Path) -> str | None:
    """The HF docs' ZeRO-3 order: TrainingArguments first, then ``from_config``, which builds the model under
    DeepSpeed's ``zero.Init`` (partitioned over the whole world). The hybrid must refuse it."""
    try:
        args = arguments(case, out)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(model_config())
        Trainer(model=model, args=args, train_dataset=CountingDataset()).train()
        return None
    except Exception as error:  # noqa: BLE001 - the test checks the message
        return error_text(error)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    options = parser.parse_args()
    distributed_state_on_cpu()
    results: dict[str, Any] = {}
    for case in CASES:
        # A fresh Accelerator (and its DeepSpeed plugin) per Trainer, on the same distributed state: what
        # TrainingArguments does itself when it makes the state (it resets both).
        AcceleratorState._reset_state(reset_partial_state=False)
        results[case.name] = run_case(case, options.out)
    AcceleratorState._reset_state(reset_partial_state=False)
    results["refused/partitioned_by_hf_from_config"] = run_partitioned_by_hf(CASES[0], options.out)
    torch.save(results, options.out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
