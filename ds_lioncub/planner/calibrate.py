"""Measure this machine's local cost table (``python -m ds_lioncub.planner --calibrate``).

Each compressed aggregation runs its real code (``build_aggregation``: the packing path the
dispatcher picks, compiled kernels where they load) as rank 0 of ``p`` ranks over a transport that
moves no bytes between ranks: an all-to-all and an all-gather copy this rank's message into the
received buffer, an integer all-reduce leaves it as it is. What is timed is the work LionCub does on
the rank around its collectives (packing, the owner's vote or field sums, unpacking, the L1 scales).
The sums inside an all-reduce are the collective's own work, pipelined with its transfers, and
counted in its time (:mod:`ds_lioncub.planner.model`), so exact Lion's fp32 all-reduce has no local
work (0) and its bf16 all-reduce only the conversion to bf16 and back. ``p`` is 4, or the largest
world a k-bit all-reduce admits when that is smaller (the per-element work of every aggregation
hardly depends on ``p``: the owner of a chunk handles ``p`` rows of ``n / p`` elements). Each
figure is the fastest of ``rounds`` x ``repeats`` timed runs, each after one warm-up run (the least
disturbed by other load on the machine).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from ds_lioncub.aggregation import Bucket, build_aggregation
from ds_lioncub.comm.kbit import KbitCodec, max_allreduce_world_size
from ds_lioncub.comm.packing import packing_path
from ds_lioncub.comm.transport.base import TransportBase
from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.lion import apply_update, lion_direction, update_momentum
from ds_lioncub.planner.local_costs import LION_UPDATE, LocalCosts, aggregation_key

CALIBRATION_WORLD = 4


class LoopbackTransport(TransportBase):
    """Rank 0 of ``world_size`` ranks whose collectives move nothing between ranks (see the module docstring)."""

    name = "loopback"

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        received.copy_(send)

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        received.view(self.world_size, -1).copy_(send)

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        return None


def calibration_modes() -> list[dict[str, Any]]:
    """The LionCub params of every compressed aggregation the planner considers (k-bit: votes)."""
    modes: list[dict[str, Any]] = [{"compression": "1bit"}]
    for bits in (2, 4, 8):
        for quantizer in ("sign", "l1"):
            for algorithm in ("allreduce", "alltoall"):
                modes.append({"compression": "kbit", "bits": bits, "quantizer": quantizer, "kbit_algorithm": algorithm})
    return modes


def _world_for(params: dict[str, Any]) -> int | None:
    """The world the mode is measured at: 4, less where a k-bit all-reduce holds fewer; None if it holds no pair."""
    if params["compression"] != "kbit" or params["kbit_algorithm"] == "alltoall":
        return CALIBRATION_WORLD
    largest = max_allreduce_world_size(params["bits"], params["quantizer"])
    for world in range(min(CALIBRATION_WORLD, largest), 1, -1):
        try:
            KbitCodec.build(world, params["bits"], params["quantizer"], params["kbit_algorithm"])
            return world
        except LionCubConfigError:
            continue
    return None


def _fastest_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: first-use builds and self-checks happen here, outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _measurements(numel: int, repeats: int, generator: torch.Generator) -> dict[str, Callable[[], float]]:
    """Per table key, a function that times its work once (fastest of ``repeats``) and returns seconds per element."""
    values = torch.randn(numel, generator=generator)
    param, exp_avg, grad = values.clone(), torch.zeros(numel), torch.randn(numel, generator=generator)
    direction = torch.empty(numel)

    def lion_step() -> None:
        lion_direction(exp_avg, grad, 0.9, out=direction)
        update_momentum(exp_avg, grad, 0.99)
        apply_update(param, direction.sign_(), 1e-4, 0.1)

    timers: dict[str, Callable[[], float]] = {
        LION_UPDATE: lambda: _fastest_seconds(lion_step, repeats) / numel,
        "none/fp32": lambda: 0.0,
        "none/bf16": lambda: _fastest_seconds(lambda: values.to(torch.bfloat16).float(), repeats) / numel,
    }
    for params in calibration_modes():
        world = _world_for(params)
        if world is None:
            continue
        options = parse_config(params)
        aggregator = build_aggregation(options, LoopbackTransport(world, 0), False)
        assert aggregator is not None
        output = torch.empty(numel)

        def aggregate(aggregator: Any = aggregator, output: torch.Tensor = output) -> None:
            # start() only reads the values: they stay the same input for every run
            aggregator.finish(aggregator.start(Bucket(values, [numel], [None]), True), out=output)

        def timed(aggregate: Callable[[], None] = aggregate) -> float:
            return _fastest_seconds(aggregate, repeats) / numel

        timers[aggregation_key(options)] = timed
    return timers


def measure_local_costs(
    numel: int = 1 << 21, repeats: int = 5, rounds: int = 5, seed: int = 0, threads: int | None = None
) -> LocalCosts:
    """Seconds per element of Lion's update and of every aggregation's local work on this machine (CPU).

    ``rounds`` passes over every entry, each the fastest of ``repeats`` runs; the table keeps each
    entry's fastest pass (a pass that other load on the machine slowed down is not kept). ``threads``:
    torch's intra-op threads while measuring (default: as set), e.g. 1 for ranks that share a machine's
    cores one each.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        timers = _measurements(numel, repeats, torch.Generator().manual_seed(seed))
        table = dict.fromkeys(timers, math.inf)
        for _ in range(rounds):  # passes over all entries, so that a burst of other load spoils one pass, not an entry
            for key, timer in timers.items():
                table[key] = min(table[key], timer())
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    path = packing_path("cpu")
    measured_on = (
        f"{platform.machine()} {platform.processor() or platform.system()}, {threads_used} torch thread(s), "
        f"packing path {path.path!r}, {numel} elements, fastest of {rounds} x {repeats}"
    )
    return LocalCosts(table, measured_on)


def as_python_table(costs: LocalCosts, command: str) -> str:
    """``costs`` as the source of ``default_local_costs.py`` (how the default table is refreshed)."""
    rows = "\n".join(f'    "{key}": {value:.4g},' for key, value in sorted(costs.seconds_per_element.items()))
    return (
        f'"""The default local cost table (seconds per element).\n\nMeasured with ``{command}``; see\n'
        f":mod:`ds_lioncub.planner.local_costs` for what each entry means.\n"
        f'"""\n\nMEASURED_ON = {costs.measured_on!r}\n\nSECONDS_PER_ELEMENT = {{\n{rows}\n}}\n'
    )


__all__ = ["LoopbackTransport", "as_python_table", "calibration_modes", "measure_local_costs"]
