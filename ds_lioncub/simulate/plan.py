"""The plan ``python -m ds_lioncub.simulate`` prints before its first run: the runs, their steps, and about how long
they take here, timed on a few steps of the mode at the largest worker count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_lioncub.simulate.ds_config import RunSettings
from ds_lioncub.simulate.train import Task, train_virtual

#: Steps of the mode timed at the largest worker count before the runs start, for the plan's time estimate.
PROBE_STEPS = 2


def estimate_seconds(
    task: Task,
    options: dict[str, Any],
    settings: RunSettings,
    workers: list[int],
    steps: int,
    seeds: list[int],
    longer: Sequence[int] = (),
) -> tuple[float, float]:
    """(seconds per step, seconds for the whole comparison): :data:`PROBE_STEPS` steps of the mode timed at the
    largest worker count, the slowest, times every run's steps (exact Lion's steps are cheaper: an upper
    estimate); ``longer``: the mode's other run lengths (:func:`compare`)."""
    probe = min(PROBE_STEPS, steps)
    result = train_virtual(
        task, options, max(workers), probe, seeds[0], grad_clip=settings.grad_clip, clip_rule=settings.clip_rule
    )
    per_step = (result.gradient_seconds + result.optimizer_seconds) / probe
    return per_step, per_step * len(workers) * len(seeds) * run_steps(steps, longer)


def run_steps(steps: int, longer: Sequence[int]) -> int:
    """The steps of one worker count and seed: exact Lion's and the mode's runs of ``steps``, and the mode's of each
    other length in ``longer``."""
    return 2 * steps + sum(length for length in set(longer) if length != steps)


def duration_text(seconds: float) -> str:
    """``"40 s"``, ``"12 min"``, ``"2.9 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_text(
    workers: list[int], seeds: list[int], steps: int, per_step: float, total: float, longer: Sequence[int] = ()
) -> str:
    """The comparison before it starts: its runs, steps and about how long it takes here."""
    others = sorted({length for length in longer if length != steps})
    runs = (2 + len(others)) * len(workers) * len(seeds)
    counts = f"{len(workers)} worker count{'s' if len(workers) != 1 else ''}"
    seeded = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    each = "the mode and exact Lion" + (f", and the mode for {', '.join(map(str, others))} steps" if others else "")
    total_steps = run_steps(steps, others) * len(workers) * len(seeds)
    return (
        f"[simulate] plan: {runs} runs ({counts} x {seeded}, each {each}), {total_steps:,} steps; "
        f"about {duration_text(total)} here ({per_step:.2g} s a step at "
        f"{max(workers)} workers, timed on {min(PROBE_STEPS, steps)} steps; fewer workers and exact Lion take less)"
    )


__all__ = ["PROBE_STEPS", "duration_text", "estimate_seconds", "plan_text", "run_steps"]
