"""One rank of a `deepspeed`-launched job that trains the example GPT with every ready config.

Usage, from the repository root with it on PYTHONPATH (tests.support.launch.run_deepspeed starts it so):
  deepspeed --num_gpus N tests/workers/ds_engine_scenarios.py --out DIR --phase main|resume [--deepspeed_config F]
Each rank saves what it saw (losses, parameters, momenta, learning rates, collective counts, per-step
telemetry, error messages) to DIR/<phase>-rank<R>.pt; tests/integration/test_deepspeed_engine.py checks
them. The "lioncub_1bit_telemetry" variant writes DeepSpeed's CSV monitor files under DIR/csv/.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist

import ds_lioncub
from ds_lioncub import LionCub
from ds_lioncub.integration import find_lioncub
from examples.corpus import build_corpus
from examples.gpt import GPT, GPTConfig
from tests.support.planned_cases import planned_configs

REPO = Path(__file__).resolve().parents[2]

CONFIGS = sorted((REPO / "configs").glob("*.json"))
MODEL = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=2, d_model=32)
SEQ_LEN = 32
STEPS = 12
CHECKPOINT_STEPS = 4
SYNC_STEP = 10
TELEMETRY_JOB = "telemetry"
TELEMETRY_BUCKET_SIZE = 4096
CORPUS_BYTES = 1_000_000


class AllReduceCounter:
    """Counts deepspeed.comm.all_reduce calls on tensors larger than a flag (the engine's gradient path)."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = ds_comm.all_reduce

        def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1:
                self.calls += 1
            return self.original(tensor, *args, **kwargs)

        ds_comm.all_reduce = counting_all_reduce


def corpus() -> torch.Tensor:
    """The pinned DeepSpeed sources (the main job's corpus), the same whatever this repository holds.

    The checks compare runs bit for bit, while ZeRO and the unsharded engine sum the clipping norm
    (DeepSpeed clips at 1.0 by default) in different orders: a coordinate whose ``c`` lies within that
    rounding of 0 may flip its sign. With a corpus made of the package's own sources, every edit to
    the package moved the data and now and then landed on such a coordinate.
    """
    data, _ = build_corpus(None, CORPUS_BYTES)
    return data.long()


def batch(data: torch.Tensor, rank: int, step: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + micro)
    starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (size,), generator=generator)
    rows = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def build(config: dict[str, Any], client: str | None = None) -> Any:
    """An engine for a fresh GPT (same seed); ``client`` passes a LionCub "object" or "callable"."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    optimizer: Any = None
    if client == "object":
        optimizer = LionCub(model.named_parameters(), lr=1e-3, compression="1bit")
    elif client == "callable":
        optimizer = lambda params: LionCub(params, lr=1e-3, compression="1bit")  # noqa: E731
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, optimizer=optimizer
    )
    return engine


def master_params(engine: Any) -> list[torch.Tensor]:
    """What LionCub steps: its parameters, or ZeRO-3's flat tensors (LionCub holds them only during a step)."""
    zero3_flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if zero3_flats is not None:
        return list(zero3_flats)
    lioncub = find_lioncub(engine.optimizer)
    return lioncub._flat_params() if lioncub is not None else []


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().float().clone() for name, p in params.items()}
    return {name: p.detach().float().clone() for name, p in params.items()}


def moved_at_init(engine: Any) -> float:
    """Largest change deepspeed.initialize made to the seeded parameters (in the engine's dtype)."""
    torch.manual_seed(0)
    initial = dict(GPT(MODEL).named_parameters())
    dtype = next(engine.module.parameters()).dtype
    now = full_params(engine)
    return max((now[name].cpu() - initial[name].detach().to(dtype).float()).abs().max().item() for name in now)


def momenta(engine: Any) -> list[torch.Tensor]:
    lioncub = find_lioncub(engine.optimizer)
    return [lioncub.state[p]["exp_avg"].float().clone() for p in lioncub._flat_params()]


def train(
    engine: Any, data: torch.Tensor, first_step: int, steps: int, record: dict[str, Any] | None = None
) -> list[float]:
    rank = dist.get_rank()
    accumulation = engine.gradient_accumulation_steps()
    micro_size = engine.train_micro_batch_size_per_gpu()
    losses = []
    lioncub = find_lioncub(engine.optimizer)
    for step in range(first_step, first_step + steps):
        traffic_before = lioncub.comm_stats() if lioncub is not None else None
        lr = engine.get_lr()[0]
        watched = master_params(engine)[:1]
        before = [p.detach().float().clone() for p in watched]
        step_loss = 0.0
        for micro in range(accumulation):
            x, y = batch(data, rank, step, micro, micro_size)
            _, loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / accumulation
        losses.append(step_loss)
        if record is not None and watched:
            group = find_lioncub(engine.optimizer).param_groups[0]
            decayed = before[0] * (1 - lr * group["weight_decay"])
            moved = (decayed - watched[0].detach().float()).abs()
            record.setdefault("lr", []).append(lr)
            record.setdefault("moved_max", []).append(moved.max().item())
            record.setdefault("moved_min", []).append(moved.min().item())
            record.setdefault("lioncub_step", []).append(group["step"])
        if record is not None and lioncub is not None and traffic_before is not None:
            record.setdefault("comm_per_step", []).append(lioncub.comm_stats() - traffic_before)
            record.setdefault("telemetry", []).append(lioncub.last_step_telemetry)
            record["global_samples"] = engine.global_samples
        if record is not None and step in (SYNC_STEP - 1, SYNC_STEP):
            record[f"momenta@{step}"] = momenta(engine)
    return losses


def run_configs(args: argparse.Namespace, data: torch.Tensor) -> dict[str, Any]:
    results: dict[str, Any] = {"names": [name for name, _ in GPT(MODEL).named_parameters()]}
    variants: list[tuple[str, dict[str, Any]]] = [(path.stem, json.loads(path.read_text())) for path in CONFIGS]
    zero2 = json.loads((REPO / "configs" / "lion_zero2.json").read_text())
    for stage in (1, 3):
        variant = copy.deepcopy(zero2)
        variant["zero_optimization"]["stage"] = stage
        variants.append((f"lion_zero{stage}", variant))
    head_sync_bf16 = json.loads((REPO / "configs" / "lioncub_1bit_head_sync.json").read_text())
    head_sync_bf16["bf16"] = {"enabled": True}
    variants.append(("lioncub_1bit_head_sync_bf16", head_sync_bf16))
    # overlap=True beside its config: 1-bit with clipping at 1.0 (votes redone), 8-bit L1 with accumulation 2,
    # and bf16 (the hooks see the module's bf16 parameters, LionCub steps the wrapper's fp32 copies)
    for base, config in (
        ("lioncub_1bit", json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())),
        ("lioncub_8bit_l1", json.loads((REPO / "configs" / "lioncub_8bit_l1.json").read_text())),
        ("lioncub_1bit_head_sync_bf16", head_sync_bf16),
    ):
        overlapped = copy.deepcopy(config)
        overlapped["optimizer"]["params"]["overlap"] = True
        variants.append((f"{base}_overlap", overlapped))
    base = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())
    variants += planned_configs(base, sum(p.numel() for p in GPT(MODEL).parameters()))
    # Telemetry with vote statistics, written by DeepSpeed's CSV monitor (rank 0 writes).
    telemetry = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())
    telemetry["optimizer"]["params"]["telemetry"] = {"vote_stats": True}
    telemetry["optimizer"]["params"]["bucket_size"] = TELEMETRY_BUCKET_SIZE  # several buckets, tensors cut
    telemetry["csv_monitor"] = {"enabled": True, "output_path": str(args.out / "csv"), "job_name": TELEMETRY_JOB}
    variants.append(("lioncub_1bit_telemetry", telemetry))
    for name, config in variants:
        counter = AllReduceCounter()
        if args.deepspeed_config and Path(args.deepspeed_config).stem == name:
            # This one goes through the launcher's --deepspeed_config, as a user's job would.
            torch.manual_seed(0)
            model = GPT(MODEL)
            engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
        else:
            engine = build(config)
        record: dict[str, Any] = {"moved_at_init": moved_at_init(engine)}
        counter.calls = 0
        record["losses"] = train(engine, data, 1, STEPS, record)
        record["engine_allreduces"] = counter.calls
        record["params"] = full_params(engine)
        record["enable_backward_allreduce"] = engine.enable_backward_allreduce
        lioncub = find_lioncub(engine.optimizer)
        record["comm_stats"] = lioncub.comm_stats() if lioncub else None
        record["momenta"] = momenta(engine) if lioncub else None
        record["revoted_buckets"] = lioncub.revoted_buckets if lioncub else None
        record["buckets_launched_in_backward"] = lioncub.buckets_launched_in_backward if lioncub else None
        record["options"] = lioncub.options.model_dump() if lioncub else None
        record["parameter_numels"] = [p.numel() for p in master_params(engine)]
        ds_comm.all_reduce = counter.original
        results[f"config/{name}"] = record
    return results


def error_feedback_config(kind: str) -> dict[str, Any]:
    """configs/lioncub_8bit_l1.json as a 4-bit L1 all-to-all vote with error feedback of ``kind``."""
    config = json.loads((REPO / "configs" / "lioncub_8bit_l1.json").read_text())
    config["optimizer"]["params"].update(bits=4, kbit_algorithm="alltoall", error_feedback={"kind": kind})
    return config


#: The error-feedback configurations checkpointed beside two shipped ones (their aggregation state is saved too).
ERROR_FEEDBACK_KINDS = {"lioncub_ef_residual": "residual", "lioncub_ef21": "ef21"}
CHECKPOINTED = ("lioncub_1bit", "lioncub_4bit_sign", *ERROR_FEEDBACK_KINDS)


def run_checkpoints(args: argparse.Namespace, data: torch.Tensor) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in CHECKPOINTED:
        if name in ERROR_FEEDBACK_KINDS:
            config = error_feedback_config(ERROR_FEEDBACK_KINDS[name])
        else:
            config = json.loads((REPO / "configs" / f"{name}.json").read_text())
        uninterrupted = build(config)
        train(uninterrupted, data, 1, 2 * CHECKPOINT_STEPS)
        save_dir = str(args.out / f"ckpt-{name}")
        first = build(config)
        train(first, data, 1, CHECKPOINT_STEPS)
        first.save_checkpoint(save_dir)
        resumed = build(config)
        resumed.load_checkpoint(save_dir)
        train(resumed, data, CHECKPOINT_STEPS + 1, CHECKPOINT_STEPS)
        results[f"resume/{name}"] = {
            "uninterrupted": full_params(uninterrupted),
            "resumed": full_params(resumed),
            "uninterrupted_momenta": momenta(uninterrupted),
            "resumed_momenta": momenta(resumed),
            "uninterrupted_noise_scale": find_lioncub(uninterrupted.optimizer).noise_scale,
            "resumed_noise_scale": find_lioncub(resumed.optimizer).noise_scale,
            "aggregation_saved": "aggregation"
            in torch.load(
                sorted((Path(save_dir) / first_tag(save_dir)).glob("lioncub_dp_rank_*.pt"))[0], weights_only=True
            ),
        }
    return results


def first_tag(save_dir: str) -> str:
    return (Path(save_dir) / "latest").read_text().strip()


def run_client_optimizers(data: torch.Tensor) -> dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": 8}
    results: dict[str, Any] = {}
    for kind in ("object", "callable"):
        counter = AllReduceCounter()
        engine = build(config, client=kind)
        counter.calls = 0
        losses = train(engine, data, 1, 4)
        results[f"client/{kind}"] = {
            "enable_backward_allreduce": engine.enable_backward_allreduce,
            "engine_allreduces": counter.calls,
            "params": full_params(engine),
            "losses": losses,
            "comm_collectives": find_lioncub(engine.optimizer).comm_stats().collectives,
        }
        ds_comm.all_reduce = counter.original
    return results


def run_bad_configs() -> dict[str, Any]:
    base = {"train_micro_batch_size_per_gpu": 8}
    bad = {
        "bits": {"type": "LionCub", "params": {"compression": "kbit", "bits": 3}},
        "unknown-key": {"type": "lioncub", "params": {"lr": 1e-3, "momentun": 0.9}},
        "world-too-large": {"type": "LionCub", "params": {"compression": "kbit", "bits": 2, "quantizer": "l1"}},
    }
    results: dict[str, Any] = {}
    cases = [(name, {**base, "optimizer": optimizer}) for name, optimizer in bad.items()]
    cases.append(
        (
            "overlap-zero2",
            {
                **base,
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "LionCub", "params": {"compression": "1bit", "overlap": True}},
            },
        )
    )
    cases.append(
        (
            "zero3-hpz",
            {
                **base,
                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
                "optimizer": {"type": "LionCub", "params": {"compression": "1bit"}},
            },
        )
    )
    for name, config in cases:
        try:
            build(config)
            results[f"bad/{name}"] = None
        except Exception as error:  # noqa: BLE001 - the test checks type and message
            results[f"bad/{name}"] = f"{type(error).__name__}: {error}"
    return results


def run_resume_other_world(args: argparse.Namespace, data: torch.Tensor) -> dict[str, Any]:
    config = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())
    engine = build(config)
    engine.load_checkpoint(str(args.checkpoint))
    loaded = momenta(engine)
    losses = train(engine, data, CHECKPOINT_STEPS + 1, CHECKPOINT_STEPS)
    return {
        "loaded_momenta": loaded,
        "params": full_params(engine),
        "losses": losses,
        "lioncub_step": find_lioncub(engine.optimizer).param_groups[0]["step"],
    }


def run_fp16(data: torch.Tensor) -> dict[str, Any]:
    """fp16 (CUDA only): the loss-scaling wrapper's state-creating step must not move anything."""
    config = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())
    config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine = build(config)
    record: dict[str, Any] = {"moved_at_init": moved_at_init(engine)}
    record["losses"] = train(engine, data, 1, STEPS, record)
    record["params"] = {name: p.cpu() for name, p in full_params(engine).items()}
    record["skipped_steps"] = engine.skipped_steps
    record["telemetry_totals"] = find_lioncub(engine.optimizer).telemetry_totals
    return {"fp16": record}


OVERFLOW_STEP = 3


def overflow_snapshot(engine: Any) -> dict[str, Any]:
    """What a skipped step must leave as it was: parameters, momenta, LionCub's step count; and the skip count."""
    return {
        "params": {name: p.cpu() for name, p in full_params(engine).items()},
        "momenta": [m.cpu() for m in momenta(engine)],
        "lioncub_step": find_lioncub(engine.optimizer).param_groups[0]["step"],
        "skipped": engine.skipped_steps,
    }


def run_fp16_overflow(data: torch.Tensor) -> dict[str, Any]:
    """fp16 (CUDA only): an infinite loss at step OVERFLOW_STEP overflows the scaled gradients on every rank.

    Every rank must skip that step together: parameters, momenta and LionCub's step count as before it,
    the loss scale halved, and training going on afterwards."""
    config = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine = build(config)
    lioncub = find_lioncub(engine.optimizer)
    record: dict[str, Any] = {"losses": [], "scale": []}
    rank = dist.get_rank()
    for step in range(1, STEPS + 1):
        if step == OVERFLOW_STEP:
            record["before"] = overflow_snapshot(engine)
        x, y = batch(data, rank, step, 0, engine.train_micro_batch_size_per_gpu())
        _, loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss * float("inf") if step == OVERFLOW_STEP else loss)
        engine.step()
        record["losses"].append(loss.item())
        record["scale"].append(float(engine.optimizer.loss_scale))
        if step == OVERFLOW_STEP:
            record["after"] = overflow_snapshot(engine)
    record["params"] = {name: p.cpu() for name, p in full_params(engine).items()}
    record["skipped_steps"] = engine.skipped_steps
    record["telemetry_totals"] = lioncub.telemetry_totals
    return {"fp16-overflow": record}


def run_bf16(data: torch.Tensor) -> dict[str, Any]:
    """bf16 (here on CUDA): the 4-bit sign config as shipped, its parameters kept in bf16 by the engine."""
    config = json.loads((REPO / "configs" / "lioncub_4bit_sign.json").read_text())
    engine = build(config)
    record: dict[str, Any] = {"dtype": str(next(engine.module.parameters()).dtype)}
    record["losses"] = train(engine, data, 1, STEPS, record)
    record["params"] = {name: p.cpu() for name, p in full_params(engine).items()}
    record["comm_stats"] = find_lioncub(engine.optimizer).comm_stats()
    return {"bf16": record}


DAMAGES = ("missing", "truncated", "foreign", "other_model")


def damage(checkpoint: Path, target: Path, kind: str) -> None:
    """A copy of ``checkpoint`` with one LionCub side file damaged the way ``kind`` says."""
    import shutil

    shutil.copytree(checkpoint, target)
    tag = (target / "latest").read_text().strip()
    rank0, rank1 = target / tag / "lioncub_dp_rank_00000.pt", target / tag / "lioncub_dp_rank_00001.pt"
    if kind == "missing":
        rank1.unlink()
    elif kind == "truncated":
        data = rank0.read_bytes()
        rank0.write_bytes(data[: len(data) // 2])
    elif kind == "foreign":  # a rank-1 file of a 3-rank save, in place of this 2-rank save's
        state = torch.load(rank1, weights_only=True)
        torch.save({**state, "world_size": 3}, rank1)
    else:  # saved for a model whose first parameter had another shape
        state = torch.load(rank1, weights_only=True)
        state["parameters"][0] = state["parameters"][0].replace("(", "(7, ", 1)
        torch.save(state, rank1)


# fp32 (lioncub_1bit) and bf16 (lioncub_4bit_sign) checkpoints of the main phase, damaged each way.
DAMAGED_CONFIGS = ("lioncub_1bit", "lioncub_4bit_sign")


def run_damaged_checkpoints(args: argparse.Namespace) -> dict[str, Any]:
    """Load each damaged copy: every rank must refuse with the same message, before anything is loaded."""
    results: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for name in DAMAGED_CONFIGS:
            for kind in DAMAGES:
                damage(args.checkpoint.parent / f"ckpt-{name}", args.out / f"damaged-{name}-{kind}", kind)
    dist.barrier()
    for name in DAMAGED_CONFIGS:
        config = json.loads((REPO / "configs" / f"{name}.json").read_text())
        for kind in DAMAGES:
            engine = build(config)
            before = full_params(engine)
            try:
                engine.load_checkpoint(str(args.out / f"damaged-{name}-{kind}"))
                results[f"damaged/{name}/{kind}"] = None
            except Exception as error:  # noqa: BLE001 - the test checks type and message
                results[f"damaged/{name}/{kind}"] = f"{type(error).__name__}: {error}"
            after = full_params(engine)
            results[f"damaged/{name}/{kind}/unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("main", "resume", "fp16"), required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if args.phase == "fp16" else "gloo")
    if args.phase == "fp16":
        torch.cuda.set_device(args.local_rank)
    torch.set_num_threads(1)
    assert ds_lioncub.LionCub is LionCub
    data = corpus()
    results: dict[str, Any] = {}
    if args.phase == "main":
        results.update(run_configs(args, data))
        results.update(run_checkpoints(args, data))
        results.update(run_client_optimizers(data))
        results.update(run_bad_configs())
    elif args.phase == "resume":
        results.update(run_resume_other_world(args, data))
        results.update(run_damaged_checkpoints(args))
    else:
        results.update(run_fp16(data))
        results.update(run_fp16_overflow(data))
        results.update(run_bf16(data))
    torch.save(results, args.out / f"{args.phase}-rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
