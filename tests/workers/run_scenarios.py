"""One rank of a gloo job that runs every scenario of tests/support/scenarios.py and saves what it got.

Usage: PYTHONPATH=<repo> python tests/workers/run_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR (started by
tests.support.launch.run_ranks). The checking happens in the test process, against the brute-force
references (tests/support/checks.py); this worker only records results.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub import LionCub
from ds_lioncub.comm import CompressedBackend, legacy_padded_numel, packing
from ds_lioncub.comm.topology import create_groups, plan_hybrid
from ds_lioncub.comm.transport import LevelledSum, TorchTransport
from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_lioncub, step_with_nan_on_last_rank


def run_votes(backend: CompressedBackend, rank: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for size in sc.VOTE_SIZES:
        for step in sc.STEPS:
            for tie_break in ("alternate", "positive"):
                before = backend.comm_stats()
                out = backend.vote_1bit(sc.vote_input(size, rank, step), step, tie_break)
                results[f"1bit/{size}/{step}/{tie_break}"] = out
                results[f"1bit-stats/{size}/{step}/{tie_break}"] = backend.comm_stats() - before
        bf16_out = backend.vote_1bit(sc.laplace_input(size, rank, 1).bfloat16(), 1)
        results[f"1bit-bf16/{size}"] = bf16_out
    return results


def run_kbit(backend: CompressedBackend, rank: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for case in sc.kbit_cases(backend.world_size):
        name = sc.case_name(case)
        for step in sc.STEPS:
            update = sc.laplace_input(sc.KBIT_SIZE, rank, step)
            segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
            before = backend.comm_stats()
            try:
                out = backend.vote_kbit(update, step, tie_break="alternate", segment_sizes=segments, **case)
                results[f"kbit/{name}/{step}"] = out
            except ValueError as error:
                results[f"kbit-error/{name}/{step}"] = str(error)
            results[f"kbit-stats/{name}/{step}"] = backend.comm_stats() - before
        small = backend.vote_kbit(sc.laplace_input(5, rank, 3), 3, **case) if "kbit/" + name + "/1" in results else None
        results[f"kbit-small/{name}"] = small
    return results


def run_segmented(rank: int, world_size: int) -> dict[str, object]:
    """The gloo collectives cut into segments of a few bytes, alone and under the votes."""
    transport = TorchTransport()
    transport.segment_bytes = sc.SEGMENT_BYTES
    results: dict[str, object] = {}
    for size in sc.SEGMENTED_SIZES:
        message = sc.byte_message(size * world_size, rank)
        results[f"seg-a2a/{size}"] = transport.all_to_all(message)
        results[f"seg-a2a-issued/{size}"] = transport.wait(transport.start_all_to_all(message))
        results[f"seg-ag/{size}"] = transport.all_gather(message[:size])
        results[f"seg-ag-issued/{size}"] = transport.wait(transport.start_all_gather(message[:size]))
    results["seg-stats/collectives"] = transport.stats.collectives
    results["seg-stats/bytes_sent"] = transport.stats.bytes_sent
    backend = CompressedBackend.from_transport(transport, pipeline_chunk_numel=24 * world_size)
    results["seg-1bit"] = backend.vote_1bit(sc.laplace_input(sc.KBIT_SIZE, rank, 1), 1)
    for case in sc.SEGMENTED_KBIT_CASES:
        segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
        update = sc.laplace_input(sc.KBIT_SIZE, rank, 2)
        results[f"seg-kbit/{sc.case_name(case)}"] = backend.vote_kbit(update, 2, segment_sizes=segments, **case)
    return results


def run_levelled_sum(rank: int, world_size: int) -> dict[str, object]:
    """The ZeRO hybrid's world-wide sum in levels, on the hybrid's own groups: inside each node, then across."""
    groups = create_groups(plan_hybrid(world_size, sc.levelled_sum_node_size(world_size)), rank)
    levelled = LevelledSum(
        [TorchTransport(group) for group in (groups.node_group, groups.vote_group) if group is not None]
    )
    floats = sc.levelled_sum_input(rank)
    integers = torch.tensor([rank + 1, 1], dtype=torch.int32)
    return {
        "levelled/floats": levelled.all_reduce_sum(floats),
        "levelled/integers": levelled.all_reduce_sum(integers),
        "levelled/world_size": levelled.world_size,
        "levelled/bytes_sent": levelled.stats.bytes_sent,
    }


def run_legacy(backend: CompressedBackend, rank: int) -> dict[str, object]:
    p = backend.world_size
    numel = torch.Size(sc.LEGACY_SHAPE).numel()
    worker_error = torch.zeros(legacy_padded_numel(numel, p))
    server_error = torch.zeros(worker_error.numel() // p)
    results: dict[str, object] = {}
    for call in range(sc.LEGACY_CALLS):
        buffer = sc.legacy_input(rank, call)
        returned = backend.compressed_allreduce(buffer, worker_error, server_error, local_rank=0)
        results[f"legacy/{call}/out"] = buffer.clone()
        results[f"legacy/{call}/same-object"] = returned is buffer
        results[f"legacy/{call}/worker_error"] = worker_error.clone()
        results[f"legacy/{call}/server_error"] = server_error.clone()
    return results


def train_mode(
    rank: int, mode: str, options: dict[str, object], pipelined: bool, prefix: str = ""
) -> dict[str, object]:
    """TRAIN_STEPS steps of one mode, its buckets pipelined (the default) or run one by one ("serial" keys);
    every key starts with ``prefix``."""
    results: dict[str, object] = {}
    keys = prefix + ("train" if pipelined else "train-serial")
    params = fresh_params()
    optimizer = scenario_lioncub(params, **options)
    optimizer.rank_step.pipelined = pipelined
    for step in range(1, sc.TRAIN_STEPS + 1):
        optimizer.zero_grad()
        sc.loss_of(params, rank, step).backward()
        before = optimizer.comm_stats()
        optimizer.step()
        results[f"{keys}-stats/{mode}/{step}"] = optimizer.comm_stats() - before
        if pipelined:
            results[f"{prefix}train-telemetry/{mode}/{step}"] = optimizer.last_step_telemetry
            results[f"{prefix}train-noise/{mode}/{step}"] = optimizer.noise_scale
        if "clip" in options:
            results[f"{keys}-clip/{mode}/{step}"] = optimizer.last_clip_coefficient
        if "momentum_sync" in options:
            for name, param in params.items():
                results[f"{keys}-exp-avg/{mode}/{step}/{name}"] = optimizer.state[param]["exp_avg"].clone()
    if pipelined:
        results[f"{prefix}train-telemetry-totals/{mode}"] = optimizer.telemetry_totals
    for name, param in params.items():
        results[f"{keys}-param/{mode}/{name}"] = param.detach().clone()
        results[f"{keys}-exp-avg/{mode}/final/{name}"] = optimizer.state[param]["exp_avg"].clone()
    return results


def train_overlap_case(
    rank: int, world_size: int, case: str, overlap: bool, device: str | torch.device = "cpu"
) -> dict[str, object]:
    """One of scenarios.OVERLAP_CASES for TRAIN_STEPS steps, with or without overlap (results on the CPU)."""
    options, accumulation, clip, unused_rank, inf_at = sc.OVERLAP_CASES[case]
    params = fresh_params(device)
    optimizer = scenario_lioncub(params, overlap=overlap, **options)
    loss_fn = sc.loss_without_b2 if unused_rank is not None and rank == unused_rank % world_size else sc.loss_of
    inf_step = None if inf_at is None or rank != inf_at[0] % world_size else inf_at[1]
    results: dict[str, object] = {}
    prefix = f"overlap-{'on' if overlap else 'off'}/{case}"
    for step in range(1, sc.TRAIN_STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            if overlap and micro == accumulation - 1:
                optimizer.overlap_next_backward()
            loss_fn(params, rank, 10 * step + micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        if step == inf_step:
            params["b1"].grad[0] = float("inf")
        try:
            optimizer.step()
        except FloatingPointError as error:
            results[f"{prefix}/error/{step}"] = str(error)
    for name, param in params.items():
        results[f"{prefix}/param/{name}"] = param.detach().cpu().clone()
        momentum = optimizer.state[param].get("exp_avg")  # none for b2 when a world of one leaves it out
        results[f"{prefix}/exp-avg/{name}"] = None if momentum is None else momentum.cpu().clone()
    results[f"{prefix}/revoted"] = optimizer.revoted_buckets
    results[f"{prefix}/launched-in-backward"] = optimizer.buckets_launched_in_backward
    return results


def overlap_groups_across_bind(rank: int, world_size: int) -> dict[str, object]:
    """An overlap optimizer bound (as DeepSpeed does) to a new group of the same ranks: the process groups
    it creates, and one armed step after the bind against the same step without overlap."""
    real_new_group = dist.new_group
    created: list[object] = []

    def counting_new_group(*args: Any, **kwargs: Any) -> Any:
        created.append(kwargs.get("ranks"))
        return real_new_group(*args, **kwargs)

    results: dict[str, object] = {}
    params, plain_params = fresh_params(), fresh_params()
    dist.new_group = counting_new_group  # type: ignore[assignment]
    try:
        optimizer = scenario_lioncub(params, compression="1bit", overlap=True)
        results["overlap-bind/groups-at-construction"] = len(created)
        same_ranks = real_new_group(ranks=list(range(world_size)))
        optimizer.bind(same_ranks, None, gradients_averaged=False)
        results["overlap-bind/groups-after-bind"] = len(created)
    finally:
        dist.new_group = real_new_group  # type: ignore[assignment]
    plain = scenario_lioncub(plain_params, compression="1bit")
    optimizer.overlap_next_backward()
    sc.loss_of(params, rank, 1).backward()
    optimizer.step()
    sc.loss_of(plain_params, rank, 1).backward()
    plain.step()
    results["overlap-bind/same-step"] = all(torch.equal(params[n], plain_params[n]) for n in params)
    return results


def run_training(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {"packing-path": packing.packing_path("cpu").path}
    modes = sc.training_modes(world_size)
    for mode, options in modes.items():
        results.update(train_mode(rank, mode, options, pipelined=True))
        if options["compression"] != "none":
            results.update(train_mode(rank, mode, options, pipelined=False))
    for mode, options in sc.error_feedback_modes(world_size).items():  # beside the modes, with the "ef/" prefix
        results.update(train_mode(rank, mode, options, pipelined=True, prefix="ef/"))
        results.update(train_mode(rank, mode, options, pipelined=False, prefix="ef/"))
    for mode, options in sc.clip_modes(world_size).items():  # beside the modes, with the "clip/" prefix
        results.update(train_mode(rank, mode, options, pipelined=True, prefix="clip/"))
        results.update(train_mode(rank, mode, options, pipelined=False, prefix="clip/"))
    # The sign votes again on the torch packing path (the composition the fused kernels must equal).
    packing.set_packing_path("torch")
    for mode in sc.SIGN_VOTE_MODES:
        if mode in modes:
            results.update(train_mode(rank, mode, modes[mode], pipelined=True, prefix="torch-packing/"))
    packing.set_packing_path(None)
    for case in sc.OVERLAP_CASES:
        for overlap in (False, True):
            results.update(train_overlap_case(rank, world_size, case, overlap))
    results.update(overlap_groups_across_bind(rank, world_size))
    nan_results, optimizer = step_with_nan_on_last_rank(rank, world_size)
    results.update(nan_results)
    results["nan-no-state"] = len(optimizer.state) == 0 or all(
        not torch.any(s["exp_avg"]) for s in optimizer.state.values()
    )
    try:
        LionCub(list(sc.init_params().items()), compression="kbit", bits=2, quantizer="l1")
        results["construct-error"] = None
    except ValueError as error:
        results["construct-error"] = str(error)
    return results


def main() -> None:
    rank, world_size, store_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    # A short timeout: collectives issued in a different order on some rank fail here instead of hanging.
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    backend = CompressedBackend()
    results: dict[str, object] = {}
    results.update(run_votes(backend, rank))
    results.update(run_kbit(backend, rank))
    results.update(run_legacy(backend, rank))
    results.update(run_segmented(rank, world_size))
    results.update(run_levelled_sum(rank, world_size))
    results.update(run_training(rank, world_size))
    dist.barrier()
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
