"""The benchmarks' shared timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ds_lioncub.lion import apply_update, lion_direction, update_momentum


def median_seconds(run: Callable[[], object], repeats: int, device: torch.device | str = "cpu") -> float:
    """The median wall time of ``repeats`` calls of ``run``, after one untimed warm-up call. On a CUDA
    ``device`` each call is timed from an idle device to the end of its kernels (synchronized both sides)."""
    cuda = torch.device(device).type == "cuda"
    run()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lion_update_unit(
    numel: int, device: torch.device | str = "cpu"
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """Lion's own update of ``numel`` fp32 elements on ``device`` (direction, momentum, update: the planner
    table's ``lion_update``, the unit the local-cost benchmarks count in), as a call to time, and the two
    random vectors it was built from (``values``, ``grad``; seed 0, drawn on the CPU), for the work timed
    beside it."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(numel, generator=generator).to(device)
    grad = torch.randn(numel, generator=generator).to(device)
    momentum, direction, param = torch.zeros_like(values), torch.empty_like(values), values.clone()

    def lion() -> None:
        lion_direction(momentum, grad, 0.9, out=direction)
        update_momentum(momentum, grad, 0.99)
        apply_update(param, direction.sign_(), 1e-4, 0.1)

    return lion, values, grad
