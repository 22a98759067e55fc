"""One rank of a gloo job that checks, right after each of LionCub's collectives returns, whether gloo's worker
thread still holds a tensor it was handed (see ds_lioncub/comm/transport/released.py for why that matters).

Usage: python release_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR (tests.support.launch.run_ranks).

torch.distributed's own functions are wrapped (the real ones run) to note every CPU tensor handed to a
collective with its reference count before the call. After each transport call returns, nothing else runs
before the counts are read. The same plain torch.distributed calls without LionCub's wait are the control:
how often, on this machine at this moment, a collective returns before gloo has let go.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport import TorchTransport
from ds_lioncub.comm.transport import torch_dist as torch_dist_module

ROUNDS = 200
SEGMENT_BYTES = 64  # small enough that the 1 KiB messages below go out in several segments

handed: list[tuple[torch.Tensor, int]] = []


def noting(real: Callable[..., Any], tensor_positions: tuple[int, ...]) -> Callable[..., Any]:
    """``real``, noting the CPU tensors at ``tensor_positions`` (and tensors in lists there) with their counts."""

    def call(*args: Any, **kwargs: Any) -> Any:
        for position in tensor_positions:
            value = args[position]
            for tensor in value if isinstance(value, list) else [value]:
                handed.append((tensor, int(tensor._use_count())))
        return real(*args, **kwargs)

    return call


def still_held() -> int:
    held = sum(1 for tensor, count in handed if int(tensor._use_count()) > count)
    handed.clear()
    return held


def main() -> None:
    rank, world_size, store_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    dist.all_to_all_single = noting(dist.all_to_all_single, (0, 1))  # type: ignore[assignment]
    dist.all_reduce = noting(dist.all_reduce, (0,))  # type: ignore[assignment]
    torch_dist_module._all_gather_flat = noting(torch_dist_module._all_gather_flat, (0, 1))

    transport = TorchTransport()
    segmented = TorchTransport()
    segmented.segment_bytes = SEGMENT_BYTES
    message = torch.arange(256 * world_size, dtype=torch.int32) + rank
    calls: dict[str, Callable[[], object]] = {
        "all_to_all": lambda: transport.all_to_all(message),
        "all_gather": lambda: transport.all_gather(message),
        "all_reduce_sum": lambda: transport.all_reduce_sum(message.clone()),
        "start_all_to_all": lambda: transport.wait(transport.start_all_to_all(message)),
        "start_all_gather": lambda: transport.wait(transport.start_all_gather(message)),
        "start_all_reduce_sum": lambda: transport.wait(transport.start_all_reduce_sum(message.clone())),
        "segmented_all_to_all": lambda: segmented.all_to_all(message),
        "segmented_all_gather": lambda: segmented.all_gather(message),
    }
    results: dict[str, Any] = {}
    for name, call in calls.items():
        held = noted = 0
        for _ in range(ROUNDS):
            call()
            noted += len(handed)
            held += still_held()
        results[name] = {"held": held, "handed": noted}
    # The control: the same collectives on plain torch.distributed, no waiting for gloo to let go.
    control_held = control_handed = 0
    for _ in range(ROUNDS):
        sent = message.clone()
        work = dist.all_reduce(sent, async_op=True)
        work.wait()
        del work
        control_handed += len(handed)
        control_held += still_held()
    results["control_plain_all_reduce"] = {"held": control_held, "handed": control_handed}
    dist.barrier()
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
