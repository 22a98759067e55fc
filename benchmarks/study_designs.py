"""Which study design measures a gap most sharply per second of wall time: the instrument pilot's report.

    python -m benchmarks.study_designs --workers 64 --beta2 0.99 --mode 1bit

For each design of :data:`benchmarks.study_grid.DESIGNS` with runs present, from the paired runs
(the mode and exact Lion, same design, worker count, beta2 and seed, paired by
:func:`benchmarks.study_report.pair_with_exact`, which leaves out a pair on other data with a warning on
stderr): the per-seed gaps in % of exact Lion's validation loss (the task's 320 windows and the wide
2,048), their sample standard deviation, the 95% Student-t half-width with the seeds present, the seeds
a half-width of 1 point would take at that standard deviation (the smallest n with
t(n-1) * sd / sqrt(n) <= 1), exact Lion's own loss and seed-to-seed sd, and the wall seconds of a pair of
runs (the two runs' ``wall_s`` added, their mean over the pairs). That is wall time, not CPU time, measured
while other study processes shared the machine: a rough cost that moves with the load. A design is calm
when its paired sd is small; the cheapest design to reach the goal minimises seeds x seconds per pair.
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.study_convergence import reader_parser
from benchmarks.study_grid import DESIGNS, config_dir
from benchmarks.study_report import paired
from ds_lioncub.quantities.student_t import mean_interval, sample_sd, t_quantile
from ds_lioncub.simulate.train import gap_percent


def seeds_for(sd: float, goal: float = 1.0, most: int = 1000) -> int | None:
    """The smallest n >= 2 with t(n - 1) * sd / sqrt(n) <= goal; None if more than ``most``."""
    for n in range(2, most + 1):
        if t_quantile(n - 1) * sd / math.sqrt(n) <= goal:
            return n
    return None


def design_rows(root: Path, task: str, steps: int, workers: int, beta2: float, mode: str) -> list[str]:
    lines = [
        f"Designs at {workers} workers, beta2 {beta2}, {mode} vs exact Lion ({steps} steps): gap % per seed, "
        "mean ± 95% t half-width, paired sd, seeds for ±1 at that sd; wall s per pair: the two runs' wall time "
        "(wall_s, measured under load), not CPU time",
        "",
        "| design | lr, clip, global batch | seeds | gaps (320 windows) | mean ± hw | sd | seeds for ±1 "
        "| sd, 2,048 windows | exact val (sd) | wall s per pair |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, design in DESIGNS.items():
        pairs = paired(config_dir(root, task, steps, name), workers, beta2, mode)
        if not pairs:
            continue
        gaps = [gap for _, _, gap in pairs]
        wide = [gap_percent(m["val_loss_wide"], e["val_loss_wide"]) for m, e, _ in pairs]
        exact = [e["val_loss"] for _, e, _ in pairs]
        seconds = sum(e["wall_s"] + m["wall_s"] for m, e, _ in pairs) / len(pairs)
        if len(gaps) > 1:
            sd, sd_wide = sample_sd(gaps), sample_sd(wide)
            needed = seeds_for(sd)
            sd_text, wide_text, need_text = f"{sd:.2f}", f"{sd_wide:.2f}", str(needed) if needed else "> 1000"
            exact_text = f"{sum(exact) / len(exact):.4f} ({sample_sd(exact):.4f})"
        else:
            sd_text = wide_text = need_text = "n/a"
            exact_text = f"{exact[0]:.4f}"
        per_seed = ", ".join(f"{g:+.1f}" for g in gaps)
        lines.append(
            f"| {name} | lr {design.lr:g}, clip {design.grad_clip:g}, batch {design.global_batch} | {len(gaps)} "
            f"| {per_seed} | {mean_interval(gaps).text(1)} | "
            f"{sd_text} | {need_text} | {wide_text} | {exact_text} | {seconds:.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = reader_parser(__doc__)
    p.add_argument("--beta2", type=float, default=0.99)
    args = p.parse_args(argv)
    print("\n".join(design_rows(args.results, args.task, args.steps, args.workers, args.beta2, args.mode)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
