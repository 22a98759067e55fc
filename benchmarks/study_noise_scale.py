"""The batch against the noise scale: the task's B_simple, r at several global batches, and the model beside them.

    python -m benchmarks.study_noise_scale --results benchmarks/results/batch_sweep \\
        --designs lr5e-4_batch16 lr5e-4 lr5e-4_batch256 lr5e-4_batch1024 --workers 16

The model of the planner (McCandlish et al. 2018; ds_lioncub/planner/time_to_loss.py) says that a mode worth a
share kappa of the batch needs r = (1 + x / kappa) / (1 + x) times exact Lion's steps to reach exact Lion's loss,
x = B_noise / B. This study tests it where B changes and everything else stays: the calm design's runs
(benchmarks/study_grid.py) at global batches of 16, 64, 256 and 1,024 windows, 16 voters, T = 300 steps.

Per batch (design):

- **B_simple**, the task's gradient noise scale in windows, from exact Lion's runs at T: each run records, per
  step, the two-batch estimates of |G|^2 and tr(Sigma) per worker batch computed exactly from every worker's
  gradient (ds_lioncub/simulate/noise_terms.py). B_simple over a span of steps is b x (the mean trace) / (the mean
  |G|^2), b the windows of one worker's batch: a ratio of means, since a step's |G|^2 alone is noisy. Reported
  over the run (steps 10 to T, after the warm-up) and in blocks of 50 steps; per seed, then the mean and its 95%
  Student-t interval over the seeds.
- **r measured** (benchmarks/study_time_to_loss.py's ``summary``: the run length at which the mode's validation
  loss equals exact Lion's after T steps).
- **r of the model** at x = B_simple / B, with kappa = 2/pi (a majority vote of signs against a mean) and with
  the study's kappa at 16 voters (the batch-share cell of the shipped evidence, with its interval).
- **kappa_eff**, the kappa at which the model gives the measured r: x / (r (1 + x) - 1). Where the model holds,
  kappa_eff is the same at every batch.
- **r of the model at the end's noise scale** (B_simple over the last 50 steps, kappa the study's): what the model
  says when fed the noise scale as it stands at the end of the run, which is where a moving average of it goes.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.study_grid import DESIGNS, config_dir
from benchmarks.study_time_to_loss import summary
from ds_lioncub.planner.time_to_loss import JobBatch, MeasuredRatio, kappa_from_ratio, model_ratio, steps_ratio
from ds_lioncub.quantities.student_t import MeanInterval, mean_interval
from ds_lioncub.simulate.time_to_loss import b_simple

#: The share of the batch a majority vote of signs keeps against a mean of them (Gaussian noise): 2/pi.
SIGN_TEST_KAPPA = 2 / math.pi
#: The first step counted: the lr warm-up's steps (10) move the estimates too fast to mean anything.
FIRST_STEP = 10
BLOCK = 50


def b_simple_windows(record: dict[str, Any], first: int, end: int) -> float | None:
    """B_simple in windows over steps ``[first, end)`` of one run's JSON (:func:`ds_lioncub.simulate.time_to_loss.
    b_simple`: b x mean(trace) / mean(|G|^2), skipping steps without terms); None where the run has no terms or the
    mean |G|^2 is not positive."""
    terms = record.get("noise_terms")
    if not terms:
        return None
    pairs = [
        None if square is None or trace is None else (square, trace)
        for square, trace in zip(terms["gradient_square"], terms["trace_per_worker_batch"], strict=True)
    ]
    return b_simple(pairs, terms["worker_windows"], first, end)


def kappa_effective(r: float, noise_over_batch: float) -> float | None:
    """The kappa at which :func:`~ds_lioncub.planner.time_to_loss.model_ratio` gives ``r`` at x = B_noise / B (the
    planner's :func:`~ds_lioncub.planner.time_to_loss.kappa_from_ratio` at B / B_noise = 1 / x); None where no
    finite kappa gives it (r (1 + x) <= 1)."""
    kappa = kappa_from_ratio(r, 1 / noise_over_batch)
    return None if math.isinf(kappa) else kappa


@dataclass(frozen=True)
class BatchPoint:
    """One global batch: its noise scale (whole run and blocks), r measured and the model's."""

    design: str
    batch: int
    b_simple: MeanInterval | None
    blocks: list[tuple[int, MeanInterval | None]]
    r: MeanInterval | None
    r_seeds: int
    exact_seeds: int


def _runs(root: Path, steps: int, design: str, workers: int, mode: str, beta2: float) -> list[dict[str, Any]]:
    pattern = f"N{workers:02d}_{mode}_b2-{beta2}_seed*.json"
    return [json.loads(path.read_text()) for path in sorted(config_dir(root, "small", steps, design).glob(pattern))]


def _interval(values: list[float]) -> MeanInterval | None:
    return mean_interval(values) if values else None


def batch_point(root: Path, steps: int, design: str, workers: int, mode: str, beta2: float) -> BatchPoint:
    exact = _runs(root, steps, design, workers, "exact", beta2)
    whole = [b for b in (b_simple_windows(run, FIRST_STEP, steps) for run in exact) if b is not None]
    blocks = []
    for start in range(0, steps, BLOCK):
        values = [b for b in (b_simple_windows(run, max(start, FIRST_STEP), start + BLOCK) for run in exact) if b]
        blocks.append((start, _interval(values)))
    measured = summary(root, "small", steps, design, workers, mode, beta2)
    found = [seed for seed in measured.seeds if seed.r is not None]
    return BatchPoint(
        design, DESIGNS[design].global_batch, _interval(whole), blocks, measured.interval, len(found), len(exact)
    )


def _text(interval: MeanInterval | None, digits: int = 3) -> str:
    if interval is None:
        return "-"
    half = "n/a" if interval.half_width is None else f"{interval.half_width:.{digits}f}"
    return f"{interval.mean:.{digits}f} ± {half}"


def table(points: list[BatchPoint], kappa: float, kappa_low: float, kappa_high: float) -> str:
    """The study's table: per batch, B_simple, x = B_simple / B, r measured, the model's r at kappa 2/pi and at the
    study's kappa (its interval in brackets), and kappa_eff."""
    lines = [
        "| global batch (windows) | B_simple (windows, steps 10-T) | x = B_simple / B | r measured (seeds) "
        f"| model r, kappa 2/pi | model r, kappa {kappa:.2f} [{kappa_low:.2f}, {kappa_high:.2f}] | kappa_eff "
        f"| model r at the last {BLOCK} steps' B_simple, kappa {kappa:.2f} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        if point.b_simple is None:
            lines.append(f"| {point.batch} | - | - | {_text(point.r)} ({point.r_seeds}) | - | - | - | - |")
            continue
        last = point.blocks[-1][1]
        late = "-" if last is None else f"{model_ratio(kappa, point.batch / last.mean):.3f} (B_simple {last.mean:.0f})"
        x = point.b_simple.mean / point.batch
        low, high = model_ratio(kappa_high, 1 / x), model_ratio(kappa_low, 1 / x)
        effective = kappa_effective(point.r.mean, x) if point.r is not None else None
        lines.append(
            f"| {point.batch} | {_text(point.b_simple, 1)} ({point.exact_seeds}) | {x:.3f} | {_text(point.r)} "
            f"({point.r_seeds}) | {model_ratio(SIGN_TEST_KAPPA, 1 / x):.3f} | {model_ratio(kappa, 1 / x):.3f} "
            f"[{low:.3f}, {high:.3f}] | {'-' if effective is None else f'{effective:.2f}'} | {late} |"
        )
    return "\n".join(lines)


def planner_table(points: list[BatchPoint], anchor: BatchPoint) -> str:
    """What the planner predicts at each batch from r measured at ``anchor``'s alone (as the shipped evidence holds
    r at 64 windows with its noise scale): :func:`ds_lioncub.planner.time_to_loss.steps_ratio` at the batch's
    B / B_noise, beside r measured there. ``inside``: the measured mean lies within the prediction's interval, or
    the prediction within the measured interval."""
    lines = [
        f"| global batch (windows) | r measured (seeds) | the planner's r from r at {anchor.batch} windows | basis | "
        "agree |",
        "|---|---|---|---|---|",
    ]
    if anchor.r is None or anchor.b_simple is None:
        return "\n".join(lines)
    measured = MeasuredRatio(anchor.r.mean, anchor.r.half_width, anchor.r_seeds, anchor.batch, anchor.b_simple.mean)
    for point in points:
        if point.b_simple is None or point.r is None:
            continue
        found = steps_ratio(None, measured, JobBatch(point.batch, point.b_simple.mean))
        spread = point.r.half_width or 0.0
        low, high = found.low if found.low is not None else found.value, found.high or found.value
        agree = low <= point.r.mean <= high or point.r.mean - spread <= found.value <= point.r.mean + spread
        lines.append(
            f"| {point.batch} | {_text(point.r)} ({point.r_seeds}) | {found.text()} | {found.basis} | "
            f"{'yes' if agree else 'no'} |"
        )
    return "\n".join(lines)


def blocks_table(points: list[BatchPoint]) -> str:
    """B_simple (windows) in blocks of :data:`BLOCK` steps, per batch: how the noise scale moves over training."""
    starts = [start for start, _ in points[0].blocks] if points else []
    head = "| global batch | " + " | ".join(f"steps {max(s, FIRST_STEP)}-{s + BLOCK}" for s in starts) + " |"
    lines = [head, "|---|" + "---|" * len(starts)]
    for point in points:
        cells = " | ".join("-" if block is None else f"{block.mean:.1f}" for _, block in point.blocks)
        lines.append(f"| {point.batch} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/batch_sweep"))
    p.add_argument("--designs", nargs="+", default=["lr5e-4_batch16", "lr5e-4", "lr5e-4_batch256", "lr5e-4_batch1024"])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--mode", default="1bit_sketchclip")
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument(
        "--kappa",
        type=float,
        nargs=3,
        default=(0.858, 0.62, 1.0),
        metavar=("VALUE", "LOW", "HIGH"),
        help="the study's kappa and its interval (default: the shipped evidence's 1bit+clip at 16 voters)",
    )
    p.add_argument(
        "--anchor",
        default="lr5e-4",
        help="the design whose r the planner's evidence holds, carried to the others (default: %(default)s)",
    )
    args = p.parse_args(argv)
    points = [batch_point(args.results, args.steps, d, args.workers, args.mode, args.beta2) for d in args.designs]
    print(table(points, *args.kappa))
    print()
    anchor = next((point for point in points if point.design == args.anchor), None)
    if anchor is not None:
        print(planner_table(points, anchor))
        print()
    print(blocks_table(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
