"""Steps to exact Lion's loss on your own task: r, what a mode costs in steps, measured in the virtual world.

``python -m ds_lioncub.simulate cfg.json --steps T --time-to-loss 1.25 1.5`` trains, per worker count and seed,
exact Lion for T steps (its validation loss is the target) and the mode with its cosine schedule fitted to each
length L in T x (1, and each multiple given). r is L* / T, where L* is the length at which the mode's
validation loss reaches the target (:func:`crossing`): linear in L between the two lengths whose losses bracket
it; where the shortest run is already at or below it (the mode beats exact Lion in steps), on the line through
the two shortest, marked extrapolated; a seed whose longest run stays above the target is *not bracketed*
(r > L_max / T), named, and left out of the mean. Per worker count: r's mean over the bracketed seeds with the
half-width of its two-sided 95% Student-t interval, and the noise scale the runs trained at: B_simple of exact
Lion's run, its average over the steps after the warm-up (:func:`b_simple`: the mean of tr(Sigma) over the mean
of |G|^2, the average the planner's model needs, docs/user-guide.md "What a mode costs in steps").

:func:`evidence_summary` writes what the planner reads (``--evidence-out``; the planner's ``--job-evidence``):
one cell per worker count in the format of ``convergence_evidence.json``, with r, the batch and that noise scale,
so the planner can place r against the job's B / B_noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.planner.bits import bits_per_element
from ds_lioncub.planner.convergence import study_mode
from ds_lioncub.quantities.student_t import MeanInterval, mean_interval
from ds_lioncub.simulate.ds_config import RunSettings


def crossing(points: list[tuple[int, float]], target: float) -> tuple[float | None, str, int]:
    """The length at which the losses ``points`` ((length, val loss), any order, two or more) reach ``target``,
    linear between the two lengths around the first crossing from above: (length, "", 0). Where the shortest run
    is already at or below it: (length, "<=", L_min), the length on the line through the two shortest runs (at
    most L_min), or (None, "<=", L_min) when that line does not fall. Not reached by the longest run:
    (None, ">", L_max)."""
    ordered = sorted(points)
    if ordered[0][1] <= target:
        (short, short_loss), (long, long_loss) = ordered[0], ordered[1]
        if long_loss >= short_loss:
            return None, "<=", short
        return short + (long - short) * (short_loss - target) / (short_loss - long_loss), "<=", short
    for (short, short_loss), (long, long_loss) in zip(ordered[:-1], ordered[1:], strict=True):
        if short_loss > target >= long_loss:
            return short + (long - short) * (short_loss - target) / (short_loss - long_loss), "", 0
    return None, ">", ordered[-1][0]


@dataclass(frozen=True)
class SeedRatio:
    """One seed's r. ``r``: L* / T where found, else None with ``bound`` saying where it lies (``"> 1.50"``: not
    reached by the longest run; ``"<= 1.00"``: reached by the shortest, whose next run does not fall).
    ``extrapolated``: L* lies below the shortest run, on the line through the two shortest."""

    seed: int
    r: float | None
    bound: str = ""
    extrapolated: bool = False


def seed_ratio(seed: int, points: list[tuple[int, float]], target: float, steps: int) -> SeedRatio:
    """r of one seed: the mode's (length, val loss) ``points`` against exact Lion's val loss ``target`` after
    ``steps``."""
    at, side, limit = crossing(points, target)
    if at is None:
        return SeedRatio(seed, None, f"{side} {limit / steps:.2f}")
    return SeedRatio(seed, at / steps, extrapolated=side == "<=")


def run_lengths(steps: int, multiples: Sequence[float]) -> list[int]:
    """The mode's run lengths: ``steps`` and ``steps`` x each multiple, rounded, without repeats, shortest first."""
    return sorted({steps, *(round(steps * multiple) for multiple in multiples)})


def b_simple(
    terms: Sequence[tuple[float, float] | None], worker_samples: int, first: int, end: int | None = None
) -> float | None:
    """B_simple in samples over steps ``[first, end)`` (``end`` None: to the last) of one run's noise terms (per step
    ``(|G|^2, tr(Sigma) per worker batch)``, None where a step's gradient was not finite): b x mean(trace) /
    mean(|G|^2), b the samples of one worker's batch; None without a step, or where the mean |G|^2 is not
    positive."""
    kept = [term for term in terms[first:end] if term is not None]
    if not kept:
        return None
    square = sum(term[0] for term in kept) / len(kept)
    trace = sum(term[1] for term in kept) / len(kept)
    return worker_samples * trace / square if square > 0 else None


@dataclass(frozen=True)
class RatioRow:
    """r at one worker count: every seed's, their mean and 95% interval over the bracketed seeds (None where no
    seed is), and the noise scale B_simple (samples) of exact Lion's runs over the seeds (None without terms).

    Fields:
        workers: N (under a ZeRO hybrid, nodes).
        seeds: each seed's r, in seed order.
        r: the mean over the bracketed seeds with its 95% Student-t interval.
        noise_scale: exact Lion's run-average B_simple over the seeds.
        batch_samples: the task's global batch, in its samples.
        lengths: the mode's run lengths, in steps.
    """

    workers: int
    seeds: tuple[SeedRatio, ...]
    r: MeanInterval | None
    noise_scale: MeanInterval | None
    batch_samples: int
    lengths: tuple[int, ...]

    @property
    def unbracketed(self) -> tuple[SeedRatio, ...]:
        return tuple(seed for seed in self.seeds if seed.r is None)


def ratio_row(
    workers: int, seeds: Sequence[SeedRatio], noise: Sequence[float | None], batch_samples: int, lengths: list[int]
) -> RatioRow:
    """One worker count's :class:`RatioRow` from its seeds' r and their exact runs' B_simple."""
    found = [seed.r for seed in seeds if seed.r is not None]
    scales = [value for value in noise if value is not None]
    return RatioRow(
        workers,
        tuple(seeds),
        mean_interval(found) if found else None,
        mean_interval(scales) if scales else None,
        batch_samples,
        tuple(lengths),
    )


def format_ratios(rows: Sequence[RatioRow], steps: int) -> str:
    """The time-to-loss table: r (mean ± 95% half-width over the bracketed seeds), the noise scale with B / B_noise,
    the seeds not bracketed, and each seed's r (``*``: extrapolated below the shortest run)."""
    lengths = ", ".join(str(length) for length in rows[0].lengths) if rows else ""
    lines = [
        f"steps to exact Lion's loss after {steps} steps (r; the mode trained for {lengths} steps, each with its own "
        "cosine schedule):",
        f"{'workers':>7}  {'r (mean ± 95% t)':>17}  {'B_simple (B/B_noise)':>20}  {'not bracketed':<14}  per seed",
    ]
    for row in rows:
        ratio = "n/a"
        if row.r is not None:
            spread = "n/a" if row.r.half_width is None else f"{row.r.half_width:.3f}"
            ratio = f"{row.r.mean:.3f} ± {spread}"
        scale = "-"
        if row.noise_scale is not None:
            scale = f"{row.noise_scale.mean:.3g} ({row.batch_samples / row.noise_scale.mean:.3g})"
        missing = ", ".join(f"{s.seed}: r {s.bound}" for s in row.unbracketed) or "-"
        found = [s for s in row.seeds if s.r is not None]
        per_seed = ", ".join(f"{s.seed}: {s.r:.3f}{'*' if s.extrapolated else ''}" for s in found) or "-"
        lines.append(f"{row.workers:>7}  {ratio:>17}  {scale:>20}  {missing:<14}  {per_seed}")
    return "\n".join(lines)


def evidence_summary(
    rows: Sequence[RatioRow],
    gaps: Sequence[tuple[int, MeanInterval]],
    options: dict[str, Any],
    beta2: float,
    source: str,
) -> dict[str, Any]:
    """The planner's evidence for the mode ``options`` (as it trained: option clip included where it clipped) at
    each worker count: ``gaps`` ((workers, the gap in % over seeds)) and, where ``rows`` has it, r with its
    interval, seeds, batch and noise scale (``convergence_evidence.json``'s fields, what
    :func:`ds_lioncub.planner.evidence.read_evidence` reads)."""
    key = study_key(options)
    ratios = {row.workers: row for row in rows}
    voted = {"compression": "1bit"} if key.startswith("1bit") else options
    cells = []
    for workers, gap in gaps:
        cell: dict[str, Any] = {
            "mode": key,
            "workers": workers,
            "beta2": beta2,
            "gap_percent": round(gap.mean, 3),
            "half_width_percent": None if gap.half_width is None else round(gap.half_width, 3),
            "seeds": len(gap.values),
            "bits_per_element": bits_per_element(voted, workers),
            "source": source,
        }
        row = ratios.get(workers)
        if row is not None and row.r is not None:
            cell.update(
                {
                    "r": round(row.r.mean, 4),
                    "r_half_width": None if row.r.half_width is None else round(row.r.half_width, 4),
                    "r_seeds": len(row.r.values),
                    "r_batch_samples": row.batch_samples,
                }
            )
            if row.noise_scale is not None:
                cell["r_noise_scale_samples"] = round(row.noise_scale.mean, 3)
                cell["r_noise_scale_runs"] = len(row.noise_scale.values)
        cells.append(cell)
    return {"source": source, "cells": cells}


def time_to_loss_lengths(steps: int, multiples: Sequence[float]) -> list[int]:
    """The mode's other run lengths for ``--time-to-loss``; refuses a multiple that is not positive or gives no
    length besides ``steps``."""
    if any(not multiple > 0 for multiple in multiples):
        raise LionCubConfigError(f"LionCub: --time-to-loss takes positive multiples of --steps, got {multiples}.")
    lengths = [length for length in run_lengths(steps, multiples) if length != steps]
    if multiples and (not lengths or min(lengths) < 1):
        raise LionCubConfigError(
            f"LionCub: --time-to-loss {' '.join(map(str, multiples))} gives no run length besides --steps {steps} "
            "(r is read between two or more lengths): give a multiple such as 1.25."
        )
    return lengths


def trained_options(options: dict[str, Any], settings: RunSettings) -> dict[str, Any]:
    """The mode's options as the runs train them: with option clip where the ds_config's gradient clipping is done
    by it (rule "mean", :func:`~ds_lioncub.simulate.train.train_virtual`), as the job runs."""
    if settings.clip_rule == "mean" and settings.grad_clip > 0 and "clip" not in options:
        return {**options, "clip": {"max_norm": settings.grad_clip}}
    return options


def study_key(options: dict[str, Any]) -> str:
    """The planner's key for the mode (:func:`~ds_lioncub.planner.convergence.study_mode`); refuses one it keeps no
    cells for."""
    key = study_mode(options)
    if key is None or key == "unmeasured":
        raise LionCubConfigError(
            f"LionCub: --evidence-out: the planner keeps no cells for this mode ({options}); leave --evidence-out out."
        )
    return key


__all__ = [
    "RatioRow",
    "SeedRatio",
    "b_simple",
    "crossing",
    "evidence_summary",
    "format_ratios",
    "ratio_row",
    "run_lengths",
    "seed_ratio",
    "study_key",
    "time_to_loss_lengths",
    "trained_options",
]
