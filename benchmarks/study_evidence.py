"""The convergence study's summary for the planner: ``ds_lioncub/planner/convergence_evidence.json``.

One job: from a study directory's runs (read and summarised by benchmarks/study_report.py), the cells the
planner and ``compression="auto"`` read (:func:`evidence`: per mode key, worker count and beta2, the gap to
exact Lion, its interval, the seeds and the mode's bits per element; where the results root has the runs for
them, the share of the batch the gap is worth, kappa, with its interval (:func:`kappa_fields`,
benchmarks/study_batch_share.py) and r, the steps to exact Lion's loss measured at the study's batch
(:func:`ratio_fields`, benchmarks/study_time_to_loss.py), with the noise scale the study ran at where a results
root holds exact Lion's runs with their noise terms (:func:`noise_scale_fields`)), and the merge of a sharper
study's points into an existing summary (:func:`merge_evidence`). ``python -m benchmarks.study_convergence
--evidence FILE [--evidence-base BASE] [--noise-scale-from ROOT]`` writes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks import study_time_to_loss
from benchmarks.study_batch_share import WHOLE, extrapolated_share, share_gaps
from benchmarks.study_grid import DESIGNS, config_dir
from benchmarks.study_noise_scale import FIRST_STEP, b_simple_windows
from benchmarks.study_report import load_runs, summarised_cells
from ds_lioncub.planner.bits import bits_per_element
from ds_lioncub.planner.convergence import study_mode
from ds_lioncub.quantities.student_t import MeanInterval, mean_interval

#: The worker count of exact Lion's batch-share runs (benchmarks/study_batch_share.py's ``--share-workers``).
SHARE_WORKERS = 8


def study_point(directory: Path) -> tuple[Path, str, int, str] | None:
    """(results root, task, steps, design) of a study directory named as benchmarks/study_grid.py names them
    (``gpt-<task>_<steps>steps[_<design>]``), or None for another name."""
    match = re.fullmatch(r"gpt-(\w+?)_(\d+)steps(?:_(.+))?", directory.name)
    if match is None:
        return None
    return directory.parent, match[1], int(match[2]), match[3] or "base"


def _share(gap: float | None, curve: list[tuple[float, float]]) -> tuple[float, bool] | None:
    return None if gap is None else extrapolated_share(gap, curve)


def kappa_fields(gap: MeanInterval, curve: list[tuple[float, float]]) -> dict[str, Any]:
    """``kappa``, the share of the batch on which exact Lion loses the cell's mean gap, and ``kappa_low`` and
    ``kappa_high`` at the upper and lower ends of its 95% interval (null without one), through exact Lion's
    share curve ``curve`` ((share, mean gap) points; :func:`benchmarks.study_batch_share.extrapolated_share`:
    linear inside it, 1 for no loss, continued as a + c / share beyond its smallest share, then
    ``kappa_extrapolated``). The curve's own uncertainty is not in the interval. {} where there is no kappa."""
    middle = _share(gap.mean, curve)
    if middle is None:
        return {}
    spread = gap.half_width
    low = _share(None if spread is None else gap.mean + spread, curve)
    high = _share(None if spread is None else gap.mean - spread, curve)
    return {
        "kappa": round(middle[0], 3),
        "kappa_low": None if low is None else round(low[0], 3),
        "kappa_high": None if high is None else round(high[0], 3),
        "kappa_extrapolated": any(share is not None and share[1] for share in (middle, low, high)),
    }


def noise_scale_fields(noise_root: Path | None, task: str, steps: int, design: str, beta2: float) -> dict[str, Any]:
    """``r_noise_scale_samples``: the noise scale B_simple the study ran at, in samples (windows), the mean over
    exact Lion's runs of the design under ``noise_root`` (any worker count: exact Lion's path does not depend on
    it) of each run's B_simple over steps 10 to ``steps`` (:func:`benchmarks.study_noise_scale.b_simple_windows`,
    the run's average, which the batch sweep found the model needs), and ``r_noise_scale_runs``, how many runs.
    {} without a root, or where it has no such run with noise terms."""
    if noise_root is None:
        return {}
    paths = sorted(config_dir(noise_root, task, steps, design).glob(f"N*_exact_b2-{beta2}_seed*.json"))
    values = [b_simple_windows(json.loads(path.read_text()), FIRST_STEP, steps) for path in paths]
    found = [value for value in values if value is not None]
    if not found:
        return {}
    return {"r_noise_scale_samples": round(sum(found) / len(found), 2), "r_noise_scale_runs": len(found)}


def ratio_fields(
    root: Path,
    task: str,
    steps: int,
    design: str,
    workers: int,
    mode: str,
    beta2: float,
    noise_root: Path | None = None,
) -> dict[str, Any]:
    """``r``, the steps the mode needs to reach exact Lion's loss after ``steps`` in units of them, measured at the
    study's batch (:func:`benchmarks.study_time_to_loss.summary`): its mean over the seeds whose r is found, its 95%
    half-width (null with one seed), the seeds, the batch in samples, the seeds whose r is beyond the runs where
    there are any, and the noise scale the study ran at where ``noise_root`` has it (:func:`noise_scale_fields`).
    {} where the root has no longer runs of the mode."""
    found = study_time_to_loss.summary(root, task, steps, design, workers, mode, beta2)
    if found.interval is None:
        return {}
    spread = found.interval.half_width
    fields: dict[str, Any] = {
        "r": round(found.interval.mean, 4),
        "r_half_width": None if spread is None else round(spread, 4),
        "r_seeds": len(found.interval.values),
        "r_batch_samples": DESIGNS[design].global_batch,
    }
    if found.unbracketed:
        fields["r_unbracketed_seeds"] = len(found.unbracketed)
    fields.update(noise_scale_fields(noise_root, task, steps, design, beta2))
    return fields


def evidence(
    directory: Path, workers: list[int], modes: list[str], beta2s: list[float], noise_root: Path | None = None
) -> dict[str, Any]:
    """The study's summary for the planner and ``compression="auto"`` (ds_lioncub/planner/convergence.py):
    one cell per (planner mode key, workers, beta2) with the gap's mean, the half-width of its 95% Student-t
    interval (both in %), the seeds, and the mode's bits per element (:func:`bits_per_element`); in the batch
    share's design (lr5e-4) where exact Lion's share runs exist at the cell's beta2, the batch share kappa
    (:func:`kappa_fields`); where the root has the mode's longer runs, r (:func:`ratio_fields`, with the noise
    scale the study ran at from ``noise_root``'s exact runs). The summary's
    ``time_to_loss`` says which cells have which.

    The planner's key comes from each run's own options (``study_mode``); two study modes with the same
    key (the 4-bit sign vote is the 1-bit vote's arithmetic) give one cell, the first in ``modes``, and the
    bits are those of the mode the key names (1 for a vote of sign fields, the 1-bit vote's key).
    """
    cells = load_runs(directory)
    point = study_point(directory)
    curves: dict[float, list[tuple[float, float]]] = {}
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int, float]] = set()
    for beta2, n, mode, row in summarised_cells(cells, workers, modes, beta2s):
        options = next(iter(cells[(beta2, n, mode)].values()))["options"]
        key = study_mode(options)
        # A momentum sync other than the study's recipe reads as the plain vote to the planner (it only moves
        # the workers toward exact Lion), but its runs are not the plain vote's evidence.
        other_sync = key == "1bit" and bool(options.get("momentum_sync"))
        if key is None or key == "unmeasured" or other_sync or (key, n, beta2) in seen:
            continue
        seen.add((key, n, beta2))
        gap: MeanInterval = row["gap"]
        # A k-bit sign vote stands for the 1-bit vote (study_mode): the cell's mode is the 1-bit vote.
        voted = {"compression": "1bit"} if key in ("1bit", "1bit+sync") else options
        cell = {
            "mode": key,
            "workers": n,
            "beta2": beta2,
            "gap_percent": round(gap.mean, 3),
            "half_width_percent": None if gap.half_width is None else round(gap.half_width, 3),
            "seeds": len(row["seeds"]),
            "bits_per_element": bits_per_element(voted, n),
        }
        if point is not None:
            root, task, steps, design = point
            if design == WHOLE and beta2 not in curves:
                shares = share_gaps(root, task, steps, SHARE_WORKERS, beta2)
                curves[beta2] = [(share, mean_interval(values).mean) for share, values in shares]
            if design == WHOLE and curves[beta2]:
                cell.update(kappa_fields(gap, curves[beta2]))
            cell.update(ratio_fields(root, task, steps, design, n, mode, beta2, noise_root))
        out.append(cell)
    return {
        # The root's name too: the first study and the pinned corpus's both hold a gpt-small_300steps.
        "source": f"benchmarks/study_convergence.py, results {directory.parent.name}/{directory.name} "
        "(benchmarks/RESULTS.md)",
        "time_to_loss": time_to_loss_note(out),
        "cells": out,
    }


def time_to_loss_note(cells: list[dict[str, Any]]) -> str:
    """Which cells carry kappa and which a measured r, in words (the planner uses the model for the rest)."""
    with_kappa = sum("kappa" in cell for cell in cells)
    measured = [
        f"{cell['mode']} at {cell['workers']} workers, beta2 {cell['beta2']} ({cell['r_seeds']} seeds)"
        for cell in cells
        if "r" in cell
    ]
    kappa = (
        f"kappa (benchmarks/study_batch_share.py) in {with_kappa} of {len(cells)} cells"
        if with_kappa
        else "no kappa (no batch-share runs beside these)"
    )
    r = f"r measured (benchmarks/study_time_to_loss.py) for {'; '.join(measured)}" if measured else "no r measured"
    return f"{kappa}; {r}; the planner uses the model, r = (1 + B_noise/(kappa B)) / (1 + B_noise/B), for the rest"


def merge_evidence(base: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """``base``'s cells, with each (workers, beta2) point that ``newer`` measured taken whole from ``newer``;
    every cell names its study in ``source`` (a cell of a file without one takes its file's).

    A sharper study of a few points (say, 64 workers at beta2 0.99) then updates the planner's evidence
    there and keeps the rest of the grid. A point is replaced whole, never cell by cell: the planner
    passes over a mode only when its interval lies above 2%, so a sharp cell beside noisy ones of the
    same point would be passed over where they, as bad or worse, are not. So ``newer`` must measure every
    mode ``base`` has at each of its points; raises ValueError naming the missing ones otherwise.
    """

    def sourced(summary: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**cell, "source": cell.get("source", summary["source"])} for cell in summary["cells"]]

    def point(cell: dict[str, Any]) -> tuple[int, float]:
        return (cell["workers"], cell["beta2"])

    newer_cells = sourced(newer)
    replaced = {point(cell) for cell in newer_cells}
    for workers, beta2 in sorted(replaced):
        have = {cell["mode"] for cell in newer_cells if point(cell) == (workers, beta2)}
        missing = sorted({cell["mode"] for cell in base["cells"] if point(cell) == (workers, beta2)} - have)
        if missing:
            raise ValueError(
                f"the newer study lacks {missing} at {workers} workers, beta2 {beta2}: run those modes there "
                "too, or leave the point out of its report (--workers, --beta2)"
            )
    cells = [cell for cell in sourced(base) if point(cell) not in replaced] + newer_cells
    cells.sort(key=lambda cell: (cell["beta2"], cell["workers"], cell["mode"]))
    return {
        "source": f"{newer['source']}; other cells: {base['source']}",
        "time_to_loss": time_to_loss_note(cells),
        "cells": cells,
    }


__all__ = [
    "bits_per_element",
    "evidence",
    "kappa_fields",
    "merge_evidence",
    "noise_scale_fields",
    "ratio_fields",
    "study_point",
]
