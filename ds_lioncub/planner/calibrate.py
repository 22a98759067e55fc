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
hardly depends on ``p``: the owner of a chunk handles ``p`` rows of ``n / p`` elements).

It is measured the way a step runs: on one LionCub bucket (``bucket_size``'s default, 8,388,608
elements, 32 MB of fp32: beyond the caches, streamed through memory as a real bucket is), and each
figure is the median of ``rounds`` x ``repeats`` timed runs (each call after one warm-up run): a step
pays the typical run, not the best one. The table is one rank's, running alone on its core(s); when
more ranks than cores share a machine, the model scales it by the ranks per core
(:func:`~ds_lioncub.planner.model.predict_aggregation_seconds`, docs/design.md, section 16).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ds_lioncub.aggregation import Bucket, build_aggregation
from ds_lioncub.comm.kbit import KbitCodec, max_allreduce_world_size
from ds_lioncub.comm.packing import packing_path
from ds_lioncub.comm.transport.base import TransportBase
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.lion import apply_update, lion_direction, update_momentum
from ds_lioncub.planner.local_costs import LION_UPDATE, LocalCosts, aggregation_key

CALIBRATION_WORLD = 4
# One LionCub bucket (its default bucket_size): the elements a step's aggregation works on at a time.
CALIBRATION_NUMEL: int = LionCubConfig.model_fields["bucket_size"].default


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


def calibration_world(params: dict[str, Any]) -> int | None:
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


def _timed_runs(run: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> list[float]:
    """Seconds of ``repeats`` runs of ``run``, after one warm-up run. ``synchronize`` waits for the device:
    CUDA kernels run asynchronously, so a run ends when its kernels have."""
    run()  # warm-up: first-use builds and self-checks happen here, outside the timing
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def _measurements(
    numel: int, repeats: int, generator: torch.Generator, device: torch.device
) -> dict[str, Callable[[], list[float]]]:
    """Per table key, a function that times its work ``repeats`` times and returns each run's seconds per element."""
    values = torch.randn(numel, generator=generator).to(device)
    param, exp_avg = values.clone(), torch.zeros(numel, device=device)
    grad = torch.randn(numel, generator=generator).to(device)
    direction = torch.empty(numel, device=device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def lion_step() -> None:
        lion_direction(exp_avg, grad, 0.9, out=direction)
        update_momentum(exp_avg, grad, 0.99)
        apply_update(param, direction.sign_(), 1e-4, 0.1)

    def per_element(run: Callable[[], object]) -> list[float]:
        return [seconds / numel for seconds in _timed_runs(run, repeats, synchronize)]

    timers: dict[str, Callable[[], list[float]]] = {
        LION_UPDATE: lambda: per_element(lion_step),
        "none/fp32": lambda: [0.0],
        "none/bf16": lambda: per_element(lambda: values.to(torch.bfloat16).float()),
    }
    for params in calibration_modes():
        world = calibration_world(params)
        if world is None:
            continue
        options = parse_config(params)
        aggregator = build_aggregation(options, LoopbackTransport(world, 0), False)
        assert aggregator is not None
        output = torch.empty(numel, device=device)

        def aggregate(aggregator: Any = aggregator, output: torch.Tensor = output) -> None:
            # start() only reads the values: they stay the same input for every run
            aggregator.finish(aggregator.start(Bucket(values, [numel], [None]), True), out=output)

        def timed(aggregate: Callable[[], None] = aggregate) -> list[float]:
            return per_element(aggregate)

        timers[aggregation_key(options)] = timed
    return timers


def measure_local_costs(
    numel: int = CALIBRATION_NUMEL,
    repeats: int = 3,
    rounds: int = 5,
    seed: int = 0,
    threads: int | None = None,
    device: str = "cpu",
) -> LocalCosts:
    """Seconds per element of Lion's update and of every aggregation's local work on this machine's ``device``
    ("cpu", or "cuda": the current CUDA device, the tensors and the packing path a CUDA rank uses).

    ``rounds`` passes over every entry, each of ``repeats`` timed runs; the table keeps each entry's
    median run (a burst of other load on the machine spoils a few runs of one pass, not an entry).
    ``threads``: torch's intra-op threads while measuring (default: as set), e.g. 1 for ranks that
    share a machine's cores one each.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if device == "cuda" and not torch.cuda.is_available():
            raise LionCubConfigError("LionCub: no CUDA device here to calibrate on; calibrate with device 'cpu'.")
        timers = _measurements(numel, repeats, torch.Generator().manual_seed(seed), torch.device(device))
        samples: dict[str, list[float]] = {key: [] for key in timers}
        for _ in range(rounds):  # passes over all entries, so that a burst of other load spoils one pass, not an entry
            for key, timer in timers.items():
                samples[key] += timer()
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    table = {key: statistics.median(runs) for key, runs in samples.items()}
    path = packing_path(device)
    where = f"{platform.machine()} {platform.processor() or platform.system()}, {threads_used} torch thread(s)"
    if device == "cuda":
        where = torch.cuda.get_device_name()
    measured_on = f"{where}, packing path {path.path!r}, {numel} elements, median of {rounds} x {repeats}"
    return LocalCosts(table, measured_on, device=device)


def as_python_table(costs: LocalCosts, command: str) -> str:
    """``costs`` as the source of ``default_local_costs.py`` (how the default table is refreshed; a CUDA table
    is printed the same way, for RESULTS.md or a table of its own)."""
    rows = "\n".join(f'    "{key}": {value:.4g},' for key, value in sorted(costs.seconds_per_element.items()))
    return (
        f'"""The default local cost table (seconds per element).\n\nMeasured with ``{command}``; see\n'
        f":mod:`ds_lioncub.planner.local_costs` for what each entry means.\n"
        f'"""\n\nMEASURED_ON = {costs.measured_on!r}\n\nSECONDS_PER_ELEMENT = {{\n{rows}\n}}\n'
    )


__all__ = [
    "CALIBRATION_NUMEL",
    "LoopbackTransport",
    "as_python_table",
    "calibration_modes",
    "calibration_world",
    "measure_local_costs",
]
