"""Steps to exact Lion's loss: r, what a mode costs in steps, measured directly.

    python -m benchmarks.study_time_to_loss --workers 32 64 \\
        --modes 1bit_sketchclip 4bit_l1_a2a_sketchclip 8bit_l1_a2a_sketchclip
    python -m benchmarks.study_time_to_loss --results /path/to/other/convergence_pinned   # a grid still running

Each mode is trained with its cosine schedule fitted to several lengths L (T, 1.25 T, 1.5 T, 2 T: the study's
runs of ``gpt-<task>_<L>steps_<design>``, benchmarks/study_convergence.py ``--steps L``) and ends at validation
loss v(L). The target is exact Lion's validation loss after T steps with the same worker count, beta2 and seed.
r is L* / T, where L* is the length at which v reaches the target, linear in L between the two lengths whose
losses bracket it (the first crossing from above). A mode whose shortest run is already at or below the target
(it beats exact Lion at T) gets L* from the line through its two shortest runs, extrapolated below L_min and
marked ``*``: leaving such seeds out would bias r upward, against the mode. A seed is *not bracketed* when its
longest run is still above the target (r > L_max / T), or when its two shortest runs do not fall; such a seed
is named, and left out of the mean. Per (mode, workers, beta2): the mean of r over the bracketed seeds and the
half-width of its two-sided 95% Student-t interval (:mod:`ds_lioncub.quantities.student_t`).

The check: by the batch-share method (:mod:`benchmarks.study_batch_share`) the mode's gap after T steps is
worth a share kappa of the batch, and the model of McCandlish et al. (2018) bounds r by 1/kappa (the limit of
a batch far below the noise scale). Printed beside r: 1/kappa from the mode's gap at T (mean, and the ends
of the gap's 95% interval), through exact Lion's share curve at T (8 workers, beta2 as the row's).

A run pairs with exact Lion's only on the same data: its first training loss (before any update) must be
exact Lion's of the same seed (:func:`benchmarks.study_report.pair_with_exact`'s criterion); a run that does
not is left out with a line on stderr. Reads only what exists, so it can follow a grid in progress.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.study_batch_share import WHOLE, extrapolated_share, share_gaps
from benchmarks.study_grid import RESULTS, config_dir
from benchmarks.study_report import paired
from ds_lioncub.quantities.student_t import MeanInterval, mean_interval
from ds_lioncub.simulate.time_to_loss import SeedRatio, seed_ratio


@dataclass(frozen=True)
class RatioSummary:
    """r over the seeds of one (mode, workers, beta2): ``interval`` over the bracketed seeds (None if none)."""

    seeds: tuple[SeedRatio, ...]
    interval: MeanInterval | None

    @property
    def unbracketed(self) -> tuple[SeedRatio, ...]:
        return tuple(seed for seed in self.seeds if seed.r is None)


#: The schedules' lengths, in units of T, that the time-to-loss issue trains (the default of ``--lengths``).
MULTIPLES = (1.0, 1.25, 1.5, 2.0)


def run_lengths(root: Path, task: str, steps: int, design: str, wanted: list[int] | None = None) -> list[int]:
    """The lengths among ``wanted`` (default: T x :data:`MULTIPLES`) with a directory of runs of ``design`` under
    ``root``; T itself always (its exact-Lion runs are the target). Only lengths of the same schedule family are
    interpolated between: a far longer run (the 1,000-step horizon study's) would put a chord across a convex
    curve, which reaches the target late and overstates r."""
    wanted = [round(steps * multiple) for multiple in MULTIPLES] if wanted is None else wanted
    base = config_dir(root, task, steps, design).name
    pattern = re.compile(re.escape(base).replace(rf"_{steps}steps", r"_(\d+)steps") + "$")
    found = {steps}
    for path in root.glob(f"gpt-{task}_*steps*"):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and int(match[1]) >= steps and int(match[1]) in wanted:
            found.add(int(match[1]))
    return sorted(found)


def _record(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def seed_ratios(
    root: Path,
    task: str,
    steps: int,
    design: str,
    workers: int,
    mode: str,
    beta2: float,
    lengths: list[int] | None = None,
) -> list[SeedRatio]:
    """r of every seed with exact Lion's run at ``steps`` and two or more of the mode's lengths (``lengths``,
    default :func:`run_lengths`'s), in seed order."""
    lengths = run_lengths(root, task, steps, design) if lengths is None else lengths
    name = f"N{workers:02d}_{{mode}}_b2-{beta2}_seed{{seed}}.json"
    seeds = set()
    for length in lengths:
        for path in config_dir(root, task, length, design).glob(name.format(mode=mode, seed="*")):
            seeds.add(int(path.stem.rsplit("seed", 1)[1]))
    ratios = []
    for seed in sorted(seeds):
        exact = _record(config_dir(root, task, steps, design) / name.format(mode="exact", seed=seed))
        if exact is None:
            continue
        points = []
        for length in lengths:
            run = _record(config_dir(root, task, length, design) / name.format(mode=mode, seed=seed))
            if run is None:
                continue
            if run["train_losses"][0] != exact["train_losses"][0]:
                print(
                    f"warning: left out {mode} at {workers} workers, beta2 {beta2}, seed {seed}, {length} steps: its "
                    f"first training loss differs from exact Lion's (trained on other data)",
                    file=sys.stderr,
                )
                continue
            points.append((length, float(run["val_loss"])))
        if len(points) < 2:
            continue
        ratios.append(seed_ratio(seed, points, float(exact["val_loss"]), steps))
    return ratios


def summary(
    root: Path,
    task: str,
    steps: int,
    design: str,
    workers: int,
    mode: str,
    beta2: float,
    lengths: list[int] | None = None,
) -> RatioSummary:
    """:func:`seed_ratios` and the mean of the seeds' r (those found, extrapolated below T included) with its 95%
    Student-t interval."""
    seeds = tuple(seed_ratios(root, task, steps, design, workers, mode, beta2, lengths))
    bracketed = [seed.r for seed in seeds if seed.r is not None]
    return RatioSummary(seeds, mean_interval(bracketed) if bracketed else None)


@dataclass(frozen=True)
class KappaCheck:
    """1/kappa from the mode's gap after T steps: at the gap's mean and at its interval's ends (``low`` from the
    lower end of the gap, ``high`` from its upper end; None without an interval or beyond the curve)."""

    gap: MeanInterval
    inverse: float | None
    low: float | None
    high: float | None
    extrapolated: bool


def _inverse(gap: float, curve: list[tuple[float, float]]) -> tuple[float | None, bool]:
    share = extrapolated_share(gap, curve)
    return (None, False) if share is None else (1 / share[0], share[1])


def kappa_check(root: Path, task: str, steps: int, workers: int, mode: str, beta2: float) -> KappaCheck | None:
    """1/kappa of ``mode`` at ``workers`` from its gap in the batch share's design (None without runs)."""
    gaps = [gap for _, _, gap in paired(config_dir(root, task, steps, WHOLE), workers, beta2, mode)]
    curve = [(share, mean_interval(values).mean) for share, values in share_gaps(root, task, steps, 8, beta2)]
    if not gaps or not curve:
        return None
    gap = mean_interval(gaps)
    inverse, extrapolated = _inverse(gap.mean, curve)
    low = high = None
    if gap.half_width is not None:
        low = _inverse(gap.mean - gap.half_width, curve)[0]
        high, beyond = _inverse(gap.mean + gap.half_width, curve)
        extrapolated = extrapolated or beyond
    return KappaCheck(gap, inverse, low, high, extrapolated)


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def ratio_text(interval: MeanInterval | None) -> str:
    """``"1.057 ± 0.017"``; ``"1.001 (1 seed)"``; ``"n/a"`` without a bracketed seed."""
    if interval is None:
        return "n/a"
    if interval.half_width is None:
        return f"{interval.mean:.3f} (1 seed)"
    return f"{interval.mean:.3f} ± {interval.half_width:.3f}"


def table(
    root: Path,
    task: str,
    steps: int,
    design: str,
    workers: list[int],
    modes: list[str],
    beta2s: list[float],
    wanted: list[int] | None = None,
) -> list[str]:
    lengths = run_lengths(root, task, steps, design, wanted)
    lines = [
        f"r: the length, in units of T = {steps} steps, at which the mode's validation loss equals exact Lion's after",
        f"T steps (same seed), linear between run lengths {', '.join(map(str, lengths))}; {root}, design {design}.",
        "*: the mode beats exact Lion at T; r below 1, on the line through its two shortest runs.",
        "1/kappa: the batch-share bound from the mode's gap at T (at the gap's mean [its 95% interval's ends]).",
        "",
        "| mode | workers | beta2 | r (mean ± 95% t) | seeds | per seed | not bracketed | gap at T % | 1/kappa |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for beta2 in beta2s:
        for n in workers:
            for mode in modes:
                found = summary(root, task, steps, design, n, mode, beta2, lengths)
                if not found.seeds:
                    continue
                r = ratio_text(found.interval)
                seeds = 0 if found.interval is None else len(found.interval.values)
                each = ", ".join(
                    f"{s.seed}: {s.r:.3f}{'*' if s.extrapolated else ''}" for s in found.seeds if s.r is not None
                )
                missing = ", ".join(f"{s.seed}: r {s.bound}" for s in found.unbracketed) or "-"
                check = kappa_check(root, task, steps, n, mode, beta2) if design == WHOLE else None
                gap = "n/a" if check is None else check.gap.text(1)
                inverse = "n/a"
                if check is not None:
                    inverse = f"{_number(check.inverse)} [{_number(check.low)}, {_number(check.high)}]"
                    inverse += " (extrapolated)" if check.extrapolated else ""
                lines.append(f"| {mode} | {n} | {beta2} | {r} | {seeds} | {each} | {missing} | {gap} | {inverse} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default: %(default)s)")
    p.add_argument("--task", choices=("small", "large"), default="small")
    p.add_argument("--steps", type=int, default=300, help="T, the length whose exact-Lion loss is the target")
    p.add_argument("--design", default=WHOLE, help="the runs' design (default: %(default)s, the batch share's)")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help="the run lengths to interpolate between, in steps (default: T x 1, 1.25, 1.5 and 2, those present)",
    )
    p.add_argument("--workers", type=int, nargs="+", default=[32, 64])
    p.add_argument("--beta2", type=float, nargs="+", default=[0.99])
    p.add_argument(
        "--modes", nargs="+", default=["1bit_sketchclip", "4bit_l1_a2a_sketchclip", "8bit_l1_a2a_sketchclip"]
    )
    args = p.parse_args(argv)
    lines = table(args.results, args.task, args.steps, args.design, args.workers, args.modes, args.beta2, args.lengths)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
