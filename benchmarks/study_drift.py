"""Do the vote's sign errors average out or accumulate? The drift recorded by the study's runs, by beta2.

    python -m benchmarks.study_drift --workers 64 --mode 1bit --beta2 0.95 0.99

Reads the ``drift`` of each run JSON of the study (:mod:`ds_lioncub.simulate.drift`: per tensor and window
of 50 steps, the sign error made, the error accumulated, exact Lion's accumulated movement, flip runs)
and prints, per beta2 and seed, the whole model's flip rate, persistence (accumulated over made error:
1 when the same coordinates err the same way all window, ``sqrt(2 / (pi k))`` for ``k`` errors in
independent directions), drift ratio (accumulated error over exact Lion's accumulated movement) and
mean flip-run length, over all windows and over the last three (late training), beside the run's gap
to exact Lion; then the same per tensor for the first seed of each beta2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.study_convergence import RESULTS, config_dir
from ds_lioncub.simulate.drift import TensorDrift, WindowDrift, overall


def drifts_of(record: dict) -> list[TensorDrift]:
    return [
        TensorDrift(**{**tensor, "windows": tuple(WindowDrift(**w) for w in tensor["windows"])})
        for tensor in record["drift"]
    ]


def late(drift: TensorDrift, windows: int = 3) -> TensorDrift:
    """The same tensor over its last ``windows`` windows only."""
    return TensorDrift(drift.name, drift.numel, drift.steps, drift.flips, drift.flip_runs, drift.windows[-windows:])


def rows(directory: Path, workers: int, mode: str, beta2s: list[float]) -> list[str]:
    lines = [
        f"Drift of the sign errors, {mode} at {workers} workers ({directory.name})",
        "",
        "| beta2 | seed | gap % | flip rate | persistence (all / last 3 windows) | drift ratio (all / last 3) "
        "| mean flip run, steps |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    firsts: dict[float, list[TensorDrift]] = {}
    for beta2 in beta2s:
        for path in sorted(directory.glob(f"N{workers:02d}_{mode}_b2-{beta2}_seed*.json")):
            record = json.loads(path.read_text())
            if not record.get("drift"):
                continue
            exact_path = directory / path.name.replace(f"_{mode}_", "_exact_")
            gap = "n/a"
            if exact_path.exists():
                exact = json.loads(exact_path.read_text())["val_loss"]
                gap = f"{100 * (record['val_loss'] - exact) / exact:+.1f}"
            tensors = drifts_of(record)
            firsts.setdefault(beta2, tensors)
            whole, last = overall(tensors), overall([late(t) for t in tensors])
            lines.append(
                f"| {beta2} | {record['seed']} | {gap} | {whole.flip_rate:.3f} | "
                f"{whole.persistence:.3f} / {last.persistence:.3f} | {whole.drift_ratio:.3f} / {last.drift_ratio:.3f} "
                f"| {whole.mean_flip_run:.2f} |"
            )
    for beta2, tensors in firsts.items():
        lines += [
            "",
            f"Per tensor, beta2 {beta2} (first seed with drift): last 3 windows",
            "",
            "| tensor | elements | flip rate | persistence | drift ratio | mean flip run |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for tensor in tensors:
            last = late(tensor)
            lines.append(
                f"| {tensor.name} | {tensor.numel:,} | {tensor.flip_rate:.3f} | {last.persistence:.3f} | "
                f"{last.drift_ratio:.3f} | {tensor.mean_flip_run:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--task", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--design", default="base")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--mode", default="1bit")
    p.add_argument("--beta2", type=float, nargs="+", default=[0.95, 0.99])
    args = p.parse_args(argv)
    directory = config_dir(args.results, args.task, args.steps, args.design)
    print("\n".join(rows(directory, args.workers, args.mode, args.beta2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
