"""What a mode's gap is worth in batch: exact Lion trained on a share of the calm design's global batch.

    python -m benchmarks.study_batch_share --workers 8
    python -m benchmarks.study_batch_share --workers 8 --modes 1bit_sketchclip 4bit_l1_a2a_sketchclip

Why: a majority vote of N signs of Gaussian values decides a mean's sign like the mean of 2N/pi of the values
(near a mean of 0, the sign is the most informative bit of a sample and keeps 2/pi of its Fisher
information; the best 3- and 4-level quantizers keep 0.81 and 0.88). If what the 1-bit vote loses against exact
Lion is that efficiency, it costs what exact Lion loses on 2/pi of the batch. The designs
``lr5e-4_batch40`` and ``lr5e-4_batch56`` (:data:`benchmarks.study_grid.DESIGNS`) train exact Lion on 40 and
56 of the calm design's 64 windows per step, everything else alike.

Printed: per batch share, exact Lion's gap to exact Lion on the whole batch (``lr5e-4``) at the same worker
count (``--share-workers``, 8: exact Lion's arithmetic does not depend on how the batch is split, only its
rounding does), beta2 and seed (mean ± 95% Student-t half-width over the seeds both have); then each mode's
gap in the calm design at ``--workers`` (:func:`benchmarks.study_report.paired`) and the share of the batch whose
exact-Lion gap it equals, interpolated linearly between the measured shares (the whole batch: gap 0). A
share of a smaller batch draws other windows than the whole batch, so its pairs are by seed alone; the first
losses, which :func:`~benchmarks.study_report.pair_with_exact` compares, differ by design.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.study_grid import DESIGNS, RESULTS, config_dir
from benchmarks.study_report import paired
from ds_lioncub.quantities.student_t import mean_interval
from ds_lioncub.simulate.train import gap_percent

#: The calm design, whose batch the shares are of.
WHOLE = "lr5e-4"
#: The designs that train exact Lion on a share of its batch.
SHARES = ("lr5e-4_batch40", "lr5e-4_batch56")


def exact_runs(directory: Path, workers: int, beta2: float) -> dict[int, float]:
    """Seed -> exact Lion's validation loss, for the runs of ``workers`` and ``beta2`` in ``directory``."""
    losses = {}
    for path in directory.glob(f"N{workers:02d}_exact_b2-{beta2}_seed*.json"):
        record = json.loads(path.read_text())
        losses[int(record["seed"])] = float(record["val_loss"])
    return losses


def share_gaps(root: Path, task: str, steps: int, workers: int, beta2: float) -> list[tuple[float, list[float]]]:
    """(share of the batch, exact Lion's per-seed gaps on it against the whole batch), by share ascending."""
    whole = exact_runs(config_dir(root, task, steps, WHOLE), workers, beta2)
    curve = []
    for design in SHARES:
        part = exact_runs(config_dir(root, task, steps, design), workers, beta2)
        gaps = [gap_percent(part[seed], whole[seed]) for seed in sorted(part.keys() & whole.keys())]
        if gaps:
            curve.append((DESIGNS[design].global_batch / DESIGNS[WHOLE].global_batch, gaps))
    return sorted(curve)


def equivalent_share(gap: float, curve: list[tuple[float, float]]) -> float | None:
    """The batch share whose exact-Lion gap is ``gap``, linear between the measured (share, mean gap) points and
    (1, 0); None outside them (a gap beyond the smallest share's, or a mean gap that does not fall with the
    share)."""
    points = [*sorted(curve), (1.0, 0.0)]
    for (low, low_gap), (high, high_gap) in zip(points[:-1], points[1:], strict=True):
        if low_gap == high_gap:
            continue
        if min(low_gap, high_gap) <= gap <= max(low_gap, high_gap):
            return low + (high - low) * (low_gap - gap) / (low_gap - high_gap)
    return None


def extrapolated_share(gap: float, curve: list[tuple[float, float]]) -> tuple[float, bool] | None:
    """The batch share a mode is worth (kappa) for the planner: :func:`equivalent_share` inside the measured
    curve, 1 for no loss (a gap of 0 or less: a mode is worth at most the whole batch), and beyond the smallest
    measured share S_1 the curve continued as gap = a + c / share through its two smallest points (the points'
    own and, with one share, the whole batch's (1, 0)): exact Lion's loss on a share s of a batch well below the
    noise scale grows as 1/s (its gradient's variance does), which the measured points follow (gap / (1/s - 1)
    is 6.0 at 40 of 64 windows, 7.0 at 56). Returns (share, extrapolated), or None without a curve or where the
    curve does not fall with the share."""
    if gap <= 0:
        return 1.0, False
    inside = equivalent_share(gap, curve)
    if inside is not None:
        return inside, False
    points = [*sorted(curve), (1.0, 0.0)]
    if len(points) < 2 or gap < points[0][1]:
        return None
    (small, small_gap), (next_share, next_gap) = points[0], points[1]
    slope = (small_gap - next_gap) / (1 / small - 1 / next_share)  # c, in points of % per unit of 1/share
    if slope <= 0:
        return None
    return 1 / (1 / small + (gap - small_gap) / slope), True


def rows(
    root: Path, task: str, steps: int, workers: int, beta2: float, modes: list[str], share_workers: int = 8
) -> list[str]:
    curve = share_gaps(root, task, steps, share_workers, beta2)
    lines = [
        f"Exact Lion on a share of the batch ({WHOLE}, {DESIGNS[WHOLE].global_batch} windows), {share_workers} "
        f"workers, beta2 {beta2}, {steps} steps: gap % to the whole batch, mean ± 95% t (seeds)",
        "",
        "| share of the batch | windows | gap % | seeds |",
        "|---:|---:|---:|---:|",
    ]
    for share, gaps in curve:
        windows = round(share * DESIGNS[WHOLE].global_batch)
        lines.append(f"| {share:.3f} | {windows} | {mean_interval(gaps).text(1)} | {len(gaps)} |")
    means = [(share, mean_interval(gaps).mean) for share, gaps in curve]
    lines += [
        "",
        f"Modes in {WHOLE} at {workers} workers: their gap, and the share of the batch exact Lion loses as much on",
        "",
        "| mode | gap % | seeds | equivalent share |",
        "|---|---:|---:|---:|",
    ]
    for mode in modes:
        gaps = [gap for _, _, gap in paired(config_dir(root, task, steps, WHOLE), workers, beta2, mode)]
        if not gaps:
            continue
        interval = mean_interval(gaps)
        lines.append(f"| {mode} | {interval.text(1)} | {len(gaps)} | {share_text(interval.mean, means)} |")
    return lines


def share_text(gap: float, curve: list[tuple[float, float]]) -> str:
    """:func:`equivalent_share` as the table prints it: two decimals; ``below S`` past the smallest measured
    share S, ``1`` for no loss (a gap of 0 or less), ``n/a`` without a curve."""
    share = equivalent_share(gap, curve)
    if share is not None:
        return f"{share:.2f}"
    if gap <= 0:
        return "1"
    return f"below {min(curve)[0]:.3f}" if curve else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default: %(default)s)")
    p.add_argument("--task", choices=("small", "large"), default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=8, help="the modes' worker count")
    p.add_argument("--share-workers", type=int, default=8, help="the worker count of exact Lion's share runs")
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--modes", nargs="+", default=["1bit", "1bit_sketchclip", "4bit_l1_a2a_sketchclip"])
    args = p.parse_args(argv)
    lines = rows(args.results, args.task, args.steps, args.workers, args.beta2, args.modes, args.share_workers)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
