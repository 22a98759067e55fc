"""Does the gap close or grow with training? A mode's gap to exact Lion along a run, from its train losses.

    python -m benchmarks.study_horizon --design lr5e-4 --steps 1000 --workers 64 --mode 1bit --beta2 0.99

For each seed with both runs (:func:`benchmarks.study_report.paired`, which leaves out a pair on other
data), the gap of the mode's mean training loss to exact Lion's over consecutive windows of ``--window``
steps, in % of exact Lion's (:func:`window_gaps`), then the final validation gap; and the mean over the
seeds of each window's gap. The training loss of a step is measured on that step's global
batch before its update, the same batch for both runs, so a window's gap compares the two models on the
same data; a window mean of 100 steps smooths the per-batch noise. Both runs follow one lr schedule over
``--steps`` (cosine decay to the end), so window k of a 1,000-step run is not the same point of training
as window k of a 300-step run.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.study_convergence import reader_parser
from benchmarks.study_grid import config_dir
from benchmarks.study_report import paired


def window_gaps(mode_losses: list[float], exact_losses: list[float], window: int) -> list[float]:
    """Per complete window of ``window`` steps, 100 x (mode's mean loss - exact's) / exact's mean loss."""
    if len(mode_losses) != len(exact_losses):
        raise ValueError(f"runs of {len(mode_losses)} and {len(exact_losses)} steps cannot be paired")
    gaps = []
    for start in range(0, len(mode_losses) - window + 1, window):
        mode_mean = sum(mode_losses[start : start + window]) / window
        exact_mean = sum(exact_losses[start : start + window]) / window
        gaps.append(100.0 * (mode_mean - exact_mean) / exact_mean)
    return gaps


def rows(directory: Path, workers: int, mode: str, beta2: float, window: int) -> list[str]:
    pairs = [
        (run["seed"], window_gaps(run["train_losses"], exact["train_losses"], window), val_gap)
        for run, exact, val_gap in paired(directory, workers, beta2, mode)
    ]
    if not pairs:
        return [f"no {mode} run at {workers} workers, beta2 {beta2} with an exact-Lion run of its seed in {directory}"]
    windows = min(len(gaps) for _, gaps, _ in pairs)
    header = " | ".join(f"{k * window}-{(k + 1) * window}" for k in range(windows))
    lines = [
        f"{mode} vs exact Lion, {workers} workers, beta2 {beta2} ({directory.name}): train-loss gap % per window of "
        f"{window} steps, then the validation gap %",
        "",
        f"| seed | {header} | val |",
        "|---" * (windows + 2) + "|",
    ]
    for seed, gaps, val_gap in pairs:
        lines.append(f"| {seed} | " + " | ".join(f"{g:+.2f}" for g in gaps[:windows]) + f" | {val_gap:+.2f} |")
    means = [sum(gaps[k] for _, gaps, _ in pairs) / len(pairs) for k in range(windows)]
    val_mean = sum(val for _, _, val in pairs) / len(pairs)
    lines.append("| mean | " + " | ".join(f"{m:+.2f}" for m in means) + f" | {val_mean:+.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = reader_parser(__doc__)
    p.add_argument("--design", default="base")
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--window", type=int, default=100, help="steps per window")
    args = p.parse_args(argv)
    directory = config_dir(args.results, args.task, args.steps, args.design)
    print("\n".join(rows(directory, args.workers, args.mode, args.beta2, args.window)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
