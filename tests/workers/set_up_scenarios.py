"""One rank of a gloo job in which LionCub is built with the same, or deliberately different, set-ups.

Usage: python set_up_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR (tests.support.launch.run_ranks).
Rank 1 differs from the others in one thing per scenario; each rank records the error it raised (or
None), and then the whole job goes on to the next scenario, which shows no rank was left behind in a
collective.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub import LionCub


def parameters(rank: int, scenario: str) -> list[tuple[str, torch.nn.Parameter]]:
    torch.manual_seed(0)
    shape = (4, 2) if scenario == "shape" and rank == 1 else (4, 3)
    named = [("w", torch.nn.Parameter(torch.randn(shape))), ("b", torch.nn.Parameter(torch.randn(4)))]
    if scenario == "count" and rank == 1:
        named.append(("extra", torch.nn.Parameter(torch.randn(2))))
    if scenario == "dtype" and rank == 1:
        named[1] = ("b", torch.nn.Parameter(torch.randn(4, dtype=torch.float64)))
    return named


def options(rank: int, scenario: str) -> dict[str, Any]:
    base: dict[str, Any] = {"lr": 1e-2, "compression": "1bit"}
    if scenario in ("checked", "perturbed"):
        base.update(consistency_check={"interval": 2})
    if rank == 1 and scenario == "compression":
        base.update(compression="kbit", bits=4)
    if rank == 1 and scenario == "lr":
        base.update(lr=2e-2)
    if scenario.startswith("auto_") and (scenario != "auto_on_one_rank" or rank == 1):
        base.update(compression="auto", network={"bandwidth": "1gbit", "latency": "50us"})
    return base


def node_size_variable(rank: int, scenario: str) -> str | None:
    """LIONCUB_NODE_SIZE as this rank's launcher would set it: "auto" plans with it."""
    if scenario == "auto_node_size_differs":
        return "1" if rank == 1 else "3"
    if scenario == "auto_node_size_invalid":
        return "two" if rank == 1 else "1"
    return None


SCENARIOS = (
    "same",
    "compression",
    "lr",
    "shape",
    "count",
    "dtype",
    "auto_node_size_differs",
    "auto_node_size_invalid",
    "auto_on_one_rank",
    "same_again",
    "checked",
    "perturbed",
)
TRAIN_STEPS = 4


def main() -> None:
    rank, world_size, store_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        named = parameters(rank, scenario)
        variable = node_size_variable(rank, scenario)
        os.environ.pop("LIONCUB_NODE_SIZE", None)
        if variable is not None:
            os.environ["LIONCUB_NODE_SIZE"] = variable
        try:
            optimizer = LionCub(named, **options(rank, scenario))
            steps = TRAIN_STEPS if scenario in ("checked", "perturbed") else 1
            for step in range(1, steps + 1):
                for _, param in named:
                    param.grad = torch.full_like(param, float(rank + step))
                optimizer.step()  # a real vote: it completes only if every rank reached it
                if scenario == "perturbed" and step == 2 and rank == 1:
                    with torch.no_grad():
                        named[1][1][0] += 1.0  # rank 1's "b" leaves the replicas after the step-2 check
            results[scenario] = None
        except Exception as error:  # noqa: BLE001 - the test checks type and message
            results[scenario] = f"{type(error).__name__}: {error}"
    dist.barrier()
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
