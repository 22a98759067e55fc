"""One rank of an MPI job that runs CompressedBackend over both transports and records what it got.

Usage:
  mpirun -np P python mpi_scenarios.py OUT_DIR full PORT
      torch.distributed (gloo) is initialised by deepspeed.init_distributed(), which finds rank and
      world size through mpi4py; every scenario of run_scenarios.py, every transport collective,
      and LionCub training run over the torch AND the MPI transport in the same job; then the
      setup errors and a DeepSpeed engine whose LionCub talks over MPI.
  deepspeed --launcher mpich --force_multi ... mpi_scenarios.py OUT_DIR engine
      the DeepSpeed engine part only, in a job started by the deepspeed launcher's MPI mode.

Run from the repository root with it on PYTHONPATH (tests/integration/test_mpi.py starts both). Each rank
saves a dict to OUT_DIR/<phase>-rank<R>.pt; tests/integration/test_mpi.py does the checking.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from mpi4py import MPI

from ds_lioncub import LionCub
from ds_lioncub.comm import CompressedBackend, MpiTransport, TorchTransport
from ds_lioncub.integration import find_lioncub
from tests.support import mpi_cases as mc
from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_lioncub, step_with_nan_on_last_rank
from tests.workers import run_scenarios as rs

BACKENDS = ("torch", "mpi")


class StagedMpiTransport(MpiTransport):
    """Takes the path device tensors take without cuda_aware (copies through host staging buffers) on CPU."""

    def _direct(self, tensor: torch.Tensor) -> bool:
        return False


def run_collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Every collective on every dtype over both transports (and MPI's staging path), with the byte counts."""
    transports = {"torch": TorchTransport(), "mpi": MpiTransport(), "staged": StagedMpiTransport()}
    results: dict[str, Any] = {}
    for name, transport in transports.items():
        for dtype_name in mc.DTYPES:
            for chunk in mc.ALL_TO_ALL_CHUNKS:
                send = mc.transport_input(1, dtype_name, chunk * world_size, rank)
                results[f"{name}:a2a/{dtype_name}/{chunk}"] = transport.all_to_all(send)
                results[f"{name}:a2a-unchanged/{dtype_name}/{chunk}"] = torch.equal(
                    send, mc.transport_input(1, dtype_name, chunk * world_size, rank)
                )
            for size in mc.ALL_GATHER_SIZES:
                results[f"{name}:gather/{dtype_name}/{size}"] = transport.all_gather(
                    mc.transport_input(2, dtype_name, size, rank)
                )
            for size in mc.ALL_REDUCE_SIZES:
                tensor = mc.transport_input(3, dtype_name, size, rank)
                returned = transport.all_reduce_sum(tensor)
                results[f"{name}:reduce/{dtype_name}/{size}"] = tensor
                results[f"{name}:reduce-in-place/{dtype_name}/{size}"] = returned is tensor
        # a non-contiguous tensor is summed in place too
        strided = mc.transport_input(3, "float32", 64, rank).view(8, 8).t()
        transport.all_reduce_sum(strided)
        results[f"{name}:reduce-strided"] = strided.clone()
        results[f"{name}:stats"] = transport.stats
        results[f"{name}:rank"] = (transport.rank, transport.world_size)
    return results


def run_backend_scenarios(rank: int) -> dict[str, Any]:
    """run_scenarios.py's votes, k-bit sums and legacy compressed_allreduce, once per transport."""
    results: dict[str, Any] = {}
    for name in BACKENDS:
        backend = CompressedBackend(comm_backend_name=name)
        results[f"{name}:backend-name"] = backend.comm_backend_name
        for part in (rs.run_votes(backend, rank), rs.run_kbit(backend, rank), rs.run_legacy(backend, rank)):
            results.update({f"{name}:{key}": value for key, value in part.items()})
    return results


def run_training(rank: int, world_size: int) -> dict[str, Any]:
    """run_scenarios.py's LionCub training modes, once per transport."""
    results: dict[str, Any] = {}
    for backend_name in BACKENDS:
        for mode, options in sc.training_modes(world_size).items():
            params = fresh_params()
            optimizer = scenario_lioncub(params, comm_backend_name=backend_name, **options)
            for step in range(1, sc.TRAIN_STEPS + 1):
                optimizer.zero_grad()
                sc.loss_of(params, rank, step).backward()
                optimizer.step()
            results[f"{backend_name}:train-stats/{mode}"] = optimizer.comm_stats()
            results[f"{backend_name}:train-transport/{mode}"] = optimizer.transport.name
            for name, param in params.items():
                results[f"{backend_name}:train-param/{mode}/{name}"] = param.detach().clone()
                results[f"{backend_name}:train-exp-avg/{mode}/final/{name}"] = optimizer.state[param]["exp_avg"].clone()
    # A NaN on the last rank stops every rank, agreed over MPI.
    nan_results, _ = step_with_nan_on_last_rank(rank, world_size, comm_backend_name="mpi")
    results.update({f"mpi:{key}": value for key, value in nan_results.items()})
    return results


def _error(build: Any) -> str | None:
    try:
        build()
    except Exception as error:  # noqa: BLE001 - the test checks type and message
        return f"{type(error).__name__}: {error}"
    return None


def run_setup_errors(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # A data-parallel group smaller than the MPI world (every rank must call new_group).
    subgroup = dist.new_group(ranks=list(range(world_size - 1)))
    results["error/subgroup"] = _error(lambda: MpiTransport(process_group=subgroup))
    results["error/subgroup-lioncub"] = _error(
        lambda: LionCub(list(sc.init_params().items()), comm_backend_name="mpi", process_group=subgroup)
    )
    # The pip-installed MPICH is not CUDA-aware and says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["error/cuda-aware"] = _error(lambda: MpiTransport(cuda_aware=True))
    results["warning/cuda-aware"] = [str(w.message) for w in caught]
    results["mpi-library"] = MPI.Get_library_version().splitlines()[0]
    return results


def run_engine(rank: int) -> dict[str, Any]:
    """A DeepSpeed engine (fp32, ZeRO 0) whose LionCub votes over MPI, on the scenario MLP and batches."""
    model = mc.Mlp()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=mc.engine_config())
    lioncub = find_lioncub(engine.optimizer)
    losses = []
    for step in range(1, mc.ENGINE_STEPS + 1):
        x, y = sc.batch(rank, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "engine/transport": lioncub.transport.name,
        "engine/enable_backward_allreduce": engine.enable_backward_allreduce,
        "engine/collectives": lioncub.comm_stats().collectives,
        "engine/losses": losses,
        "engine/params": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
        "engine/env": {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "PMI_RANK", "LOCAL_RANK")},
    }


def main() -> None:
    out_dir, phase = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if phase == "full":
        # Under plain mpirun, DeepSpeed discovers rank, size and master address through mpi4py.
        deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(sys.argv[3]), verbose=False)
    else:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    results: dict[str, Any] = {"world": (rank, world_size)}
    if phase == "full":
        results.update(run_collectives(rank, world_size))
        results.update(run_backend_scenarios(rank))
        results.update(run_training(rank, world_size))
        results.update(run_setup_errors(rank, world_size))
    results.update(run_engine(rank))
    torch.save(results, out_dir / f"{phase}-rank{rank}.pt")
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
