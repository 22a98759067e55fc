"""Do the vote's sign errors average out or accumulate? The drift recorded by the study's runs, by beta2.

    python -m benchmarks.study_drift --workers 64 --mode 1bit --beta2 0.95 0.99

Reads the ``drift`` of each run JSON of the study (:mod:`ds_lioncub.simulate.drift`: per tensor and window
of 50 steps, the sign error made, the error accumulated, exact Lion's accumulated movement; per tensor and
whole run, the flips and flip runs) and prints, per beta2 and seed, beside the run's gap to exact Lion
(paired by :func:`benchmarks.study_report.pair_with_exact`, "n/a" without an exact run of the same data):

- over the whole run: the whole model's flip rate and mean flip-run length (the record keeps these per
  run, not per window);
- over all complete windows and over the last :data:`LATE_WINDOWS` (late training), from the windows'
  sums (:func:`windowed`): persistence (accumulated over made error: 1 when the same coordinates err the
  same way all window, ``sqrt(2 / (pi k))`` for ``k`` errors in independent directions) and drift ratio
  (accumulated error over exact Lion's accumulated movement);

then the same per tensor for the first seed of each beta2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.study_convergence import reader_parser
from benchmarks.study_grid import config_dir
from benchmarks.study_report import pair_with_exact
from ds_lioncub.simulate.drift import TensorDrift, WindowDrift, drift_ratio_of, overall, persistence_of

#: The windows that stand for late training.
LATE_WINDOWS = 3


def drifts_of(record: dict[str, Any]) -> list[TensorDrift]:
    return [
        TensorDrift(**{**tensor, "windows": tuple(WindowDrift(**w) for w in tensor["windows"])})
        for tensor in record["drift"]
    ]


class Windowed(NamedTuple):
    """Persistence and drift ratio over some of a tensor's windows."""

    persistence: float
    drift_ratio: float


def windowed(drift: TensorDrift, windows: int | None = None) -> Windowed:
    """Over ``drift``'s last ``windows`` complete windows (every window for None; all it has if fewer):
    persistence = sum of ``drift_l1`` / sum of ``err_l1`` and drift ratio = sum of ``drift_l1`` / sum of
    ``exact_l1``, each 0 where its denominator is (the definitions of :class:`TensorDrift`'s properties, on
    those windows alone; the whole-run counts, flips and flip runs, play no part)."""
    kept = drift.windows if windows is None else drift.windows[-windows:]
    return Windowed(persistence_of(kept), drift_ratio_of(kept))


def rows(directory: Path, workers: int, mode: str, beta2s: list[float]) -> list[str]:
    late = LATE_WINDOWS
    lines = [
        f"Drift of the sign errors, {mode} at {workers} workers ({directory.name})",
        "",
        f"| beta2 | seed | gap % | flip rate (whole run) | persistence (all windows / last {late}) "
        f"| drift ratio (all windows / last {late}) | mean flip run, steps (whole run) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    firsts: dict[float, list[TensorDrift]] = {}
    for beta2 in beta2s:
        for path in sorted(directory.glob(f"N{workers:02d}_{mode}_b2-{beta2}_seed*.json")):
            record = json.loads(path.read_text())
            if not record.get("drift"):
                continue
            pair = pair_with_exact(directory, record)
            gap = "n/a" if pair is None else f"{pair[1]:+.1f}"
            tensors = drifts_of(record)
            firsts.setdefault(beta2, tensors)
            whole = overall(tensors)
            every, last = windowed(whole), windowed(whole, late)
            lines.append(
                f"| {beta2} | {record['seed']} | {gap} | {whole.flip_rate:.3f} | "
                f"{every.persistence:.3f} / {last.persistence:.3f} | {every.drift_ratio:.3f} / {last.drift_ratio:.3f} "
                f"| {whole.mean_flip_run:.2f} |"
            )
    for beta2, tensors in firsts.items():
        lines += [
            "",
            f"Per tensor, beta2 {beta2} (first seed with drift): persistence and drift ratio over the last {late} "
            "windows; flip rate and mean flip run over the whole run",
            "",
            f"| tensor | elements | flip rate (whole run) | persistence (last {late}) | drift ratio (last {late}) "
            "| mean flip run (whole run) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for tensor in tensors:
            last = windowed(tensor, late)
            lines.append(
                f"| {tensor.name} | {tensor.numel:,} | {tensor.flip_rate:.3f} | {last.persistence:.3f} | "
                f"{last.drift_ratio:.3f} | {tensor.mean_flip_run:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = reader_parser(__doc__)
    p.add_argument("--design", default="base")
    p.add_argument("--beta2", type=float, nargs="+", default=[0.95, 0.99])
    args = p.parse_args(argv)
    directory = config_dir(args.results, args.task, args.steps, args.design)
    print("\n".join(rows(directory, args.workers, args.mode, args.beta2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
