"""One rank of an NCCL job, one CUDA device per rank: every training mode of tests/support/scenarios.py and the
overlap cases, saved for tests/distributed/test_nccl_transport.py.

Usage (tests.support.launch.run_ranks starts it so): ``python tests/workers/nccl_scenarios.py RANK WORLD STORE OUT``.
NCCL refuses two ranks on one device, so one GPU runs a world of one: every collective still goes through
NCCL on the device's stream (a world of one sends its own message to itself), which is what this checks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub import LionCub
from ds_lioncub.comm.transport import TorchTransport
from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_settings
from tests.workers.run_scenarios import train_overlap_case


def train_mode(rank: int, options: dict[str, object], device: torch.device) -> dict[str, object]:
    """sc.TRAIN_STEPS steps of one mode on this rank's gradients (computed on the CPU as the gloo ranks
    compute them, then moved to the device): per-step traffic and momenta, final parameters, on the CPU."""
    params = fresh_params(device)
    optimizer = LionCub(list(params.items()), **scenario_settings(**options))
    results: dict[str, object] = {}
    for step in range(1, sc.TRAIN_STEPS + 1):
        before = optimizer.comm_stats()
        grads = sc.model_grads([param.detach().cpu() for param in params.values()], rank, step)
        for param, grad in zip(params.values(), grads, strict=True):
            param.grad = grad.to(device)
        optimizer.step()
        results[f"stats/{step}"] = optimizer.comm_stats() - before
        for name, param in params.items():
            results[f"exp-avg/{step}/{name}"] = optimizer.state[param]["exp_avg"].cpu().clone()
    for name, param in params.items():
        results[f"param/{name}"] = param.detach().cpu().clone()
    return results


RAW_SIZES = (1, 13, 4099)


def payload(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``rank`` sends in the raw collectives below: a pure function of (rank, numel, dtype), so every rank
    can compute every other rank's message and so the exact result of each collective."""
    generator = sc.seeded_generator(11, rank, numel, 8 if dtype == torch.uint8 else 32)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), generator=generator, dtype=torch.uint8)
    return torch.randint(-(2**20), 2**20, (numel,), generator=generator, dtype=torch.int32)


def run_raw(blocking: Callable[..., None], issued: Callable[..., Any], use_issued: bool, *args: torch.Tensor) -> None:
    """One raw collective, either blocking or issued and then waited for (an issued call may return no work)."""
    if not use_issued:
        blocking(*args)
    elif (work := issued(*args)) is not None:
        work.wait()


def raw_collectives(rank: int, world_size: int, device: torch.device) -> dict[str, bool]:
    """TorchTransport's own calls into NCCL (blocking and issued), bypassing the world-of-one shortcut that
    LionCub's steps take: byte all-to-all and all-gather, int32 sum, each against its exact result."""
    transport = TorchTransport()
    results: dict[str, bool] = {}
    for numel in RAW_SIZES:
        sent = [payload(r, numel * world_size, torch.uint8) for r in range(world_size)]
        chunks = [message.view(world_size, numel)[rank] for message in sent]
        expected_a2a = torch.cat(chunks)
        for issued in (False, True):
            received = torch.full((numel * world_size,), 7, dtype=torch.uint8, device=device)
            run_raw(transport._raw_all_to_all, transport._raw_all_to_all_async, issued, sent[rank].to(device), received)
            results[f"all-to-all/{numel}/{issued}"] = torch.equal(received.cpu(), expected_a2a)
        own = [payload(r, numel, torch.uint8) for r in range(world_size)]
        for issued in (False, True):
            gathered = torch.full((numel * world_size,), 7, dtype=torch.uint8, device=device)
            run_raw(transport._raw_all_gather, transport._raw_all_gather_async, issued, own[rank].to(device), gathered)
            results[f"all-gather/{numel}/{issued}"] = torch.equal(gathered.cpu(), torch.cat(own))
        counts = [payload(r, numel, torch.int32) for r in range(world_size)]
        for issued in (False, True):
            flat = counts[rank].to(device, copy=True)
            run_raw(transport._raw_integer_all_reduce_sum, transport._raw_integer_all_reduce_sum_async, issued, flat)
            results[f"int32-sum/{numel}/{issued}"] = torch.equal(
                flat.cpu(), torch.stack(counts).sum(0, dtype=torch.int32)
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return results


def main() -> None:
    rank, world_size, store_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{store_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    results: dict[str, object] = {"device": torch.cuda.get_device_name(device), "backend": dist.get_backend()}
    try:
        results["raw"] = raw_collectives(rank, world_size, device)
    except Exception as error:  # noqa: BLE001 - the test shows the error
        results["raw"] = f"{type(error).__name__}: {error}"
    for mode, options in sc.training_modes(world_size).items():
        try:
            results[mode] = train_mode(rank, options, device)
        except Exception as error:  # noqa: BLE001 - the test names the mode and the error
            results[mode] = f"{type(error).__name__}: {error}"
    for case in sc.OVERLAP_CASES:
        for overlap in (False, True):
            try:
                results.update(train_overlap_case(rank, world_size, case, overlap, device))
            except Exception as error:  # noqa: BLE001
                results[f"overlap-{'on' if overlap else 'off'}/{case}/failed"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
