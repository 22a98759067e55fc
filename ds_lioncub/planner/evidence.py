"""The convergence study's cells as the planner reads them: ``convergence_evidence.json`` and its cells.

The file (written by ``python -m benchmarks.study_convergence --evidence``, benchmarks/study_evidence.py) holds
one cell per (mode key, workers, beta2): the gap to exact Lion's validation loss after the study's steps, the
half-width of its 95% Student-t interval, the seeds and the mode's bits per element; and, where the study
measured them, the share of the batch the mode is worth (kappa, benchmarks/study_batch_share.py) and r, the
steps it needs to reach exact Lion's loss in units of exact Lion's (benchmarks/study_time_to_loss.py).
:mod:`ds_lioncub.planner.convergence` decides with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from ds_lioncub.planner.time_to_loss import Kappa, MeasuredRatio
from ds_lioncub.quantities.student_t import half_width_of

#: A gap whose 95% interval lies above this (in % of Lion's loss) is a loss, shown in the table with "!".
LOSS_THRESHOLD_PERCENT = 2.0
#: Seeds a cell needs before its gap can count as a loss: an interval from fewer says too little.
MIN_SEEDS = 3
EVIDENCE_FILE = Path(__file__).with_name("convergence_evidence.json")
#: What the shipped study trained (ds_lioncub/simulate/tasks/gpt_task.py, "small"; tests/unit/test_planner_ranking.py
#: counts it): the evidence every reason of the planner and "auto" rests on.
SHIPPED_STUDY = "a 0.47M-parameter GPT, 4,096-token batches (64 windows of 64 bytes), 300 steps"


@dataclass(frozen=True)
class StudyCell:
    """One (mode, workers, beta2) of the study.

    Attributes:
        mode: the study's mode key (:func:`ds_lioncub.planner.convergence.study_mode`).
        workers: N, the data-parallel workers (voters).
        beta2: Lion's beta2.
        gap_percent: mean over seeds of (mode's val loss - exact Lion's) / exact Lion's, in %.
        half_width_percent: half-width of the mean's two-sided 95% Student-t interval (t(seeds - 1) x the
            per-seed gaps' sample sd / sqrt(seeds)), in points of %; None with one seed.
        seeds: how many seeds the mean is over.
        bits_per_element: the mode's bits per gradient element in each rank's message (1 for the 1-bit vote
            and its momentum-sync form, b for a b-bit vote); None where the file does not say.
        kappa: the share of the batch the gap is worth (None where the study has no batch-share runs).
        measured_ratio: r measured at the study's batch (None where not measured).
        job: measured on the job's own task (the planner's ``--job-evidence``, :func:`with_job_cells`): it judges
            the mode wherever the job's voters are its worker count.
    """

    mode: str
    workers: int
    beta2: float
    gap_percent: float
    half_width_percent: float | None
    seeds: int
    bits_per_element: int | None = None
    kappa: Kappa | None = None
    measured_ratio: MeasuredRatio | None = None
    job: bool = False

    @property
    def low(self) -> float | None:
        """The interval's lower end, in %; None with one seed."""
        return None if self.half_width_percent is None else self.gap_percent - self.half_width_percent

    @property
    def high(self) -> float | None:
        """The interval's upper end, in %; None with one seed."""
        return None if self.half_width_percent is None else self.gap_percent + self.half_width_percent

    @property
    def loses(self) -> bool:
        """The interval's lower end above the threshold, over at least :data:`MIN_SEEDS` seeds: the gap after the
        study's steps is shown above it (the planner no longer passes a mode over for it alone)."""
        return self.seeds >= MIN_SEEDS and self.low is not None and self.low > LOSS_THRESHOLD_PERCENT

    @property
    def undecided(self) -> bool:
        """The study does not show the gap above the threshold, nor within it: the interval's upper end reaches the
        threshold, or there is no interval (one seed). A cell of fewer than :data:`MIN_SEEDS` seeds whose whole
        interval lies above the threshold is undecided too."""
        return not self.loses and (self.high is None or self.high >= LOSS_THRESHOLD_PERCENT)

    def interval_text(self) -> str:
        """``"+3.3% (95% CI +0.3 to +6.3, 3 seeds)"``; ``"+1.0% (1 seed, no interval)"``."""
        if self.low is None or self.high is None:
            return f"{self.gap_percent:+.1f}% ({self.seeds} seed{'s' if self.seeds != 1 else ''}, no interval)"
        return f"{self.gap_percent:+.1f}% (95% CI {self.low:+.1f} to {self.high:+.1f}, {self.seeds} seeds)"


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _number_or_null(value: Any) -> bool:
    return value is None or _number(value)


def _time_to_loss_fields_ok(cell: dict[str, Any]) -> bool:
    """The optional kappa and r fields, where present: numbers (their ends may be null), whole seeds."""
    if "kappa" in cell and not (
        _number(cell["kappa"])
        and _number_or_null(cell.get("kappa_low"))
        and _number_or_null(cell.get("kappa_high"))
        and type(cell.get("kappa_extrapolated", False)) is bool
    ):
        return False
    return "r" not in cell or (
        _number(cell["r"])
        and _number_or_null(cell.get("r_half_width"))
        and type(cell.get("r_seeds")) is int
        and (cell.get("r_batch_samples") is None or type(cell["r_batch_samples"]) is int)
        and _number_or_null(cell.get("r_noise_scale_samples"))
    )


def _kappa(cell: dict[str, Any]) -> Kappa | None:
    if "kappa" not in cell:
        return None
    return Kappa(cell["kappa"], cell.get("kappa_low"), cell.get("kappa_high"), cell.get("kappa_extrapolated", False))


def _measured(cell: dict[str, Any]) -> MeasuredRatio | None:
    if "r" not in cell:
        return None
    batch, noise = cell.get("r_batch_samples"), cell.get("r_noise_scale_samples")
    return MeasuredRatio(cell["r"], cell.get("r_half_width"), cell["r_seeds"], batch, noise)


def read_evidence(path: str | Path) -> tuple[StudyCell, ...]:
    """The cells of a study summary file (``{"cells": [{mode, workers, beta2, gap_percent, half_width_percent,
    seeds, bits_per_element}, ...]}``, what benchmarks/study_convergence.py --evidence writes), each with its
    optional ``kappa`` (``kappa_low``, ``kappa_high``, ``kappa_extrapolated``) and ``r`` (``r_half_width``,
    ``r_seeds``, ``r_batch_samples``, ``r_noise_scale_samples``); raises ValueError naming the first malformed
    cell.

    An older file gives ``spread_percent`` (2 x the sample sd of the per-seed gaps) instead of
    ``half_width_percent`` and no ``bits_per_element``: its half-width is t(seeds - 1) x (spread / 2) /
    sqrt(seeds), the same interval computed from the same sd.
    """
    data = json.loads(Path(path).read_text())
    cells = []
    for index, cell in enumerate(data["cells"]):
        has_half_width = "half_width_percent" in cell
        well_formed = (
            isinstance(cell.get("mode"), str)
            and type(cell.get("workers")) is int
            and type(cell.get("seeds")) is int
            and all(_number(cell.get(key)) for key in ("beta2", "gap_percent"))
            and (has_half_width or "spread_percent" in cell)
            and _number_or_null(cell.get("half_width_percent" if has_half_width else "spread_percent"))
            and (cell.get("bits_per_element") is None or type(cell["bits_per_element"]) is int)
            and _time_to_loss_fields_ok(cell)
        )
        if not well_formed:
            raise ValueError(
                f"cell {index} of {path} is not {{mode: str, workers: int, beta2: number, gap_percent: number, "
                f"half_width_percent: number or null (or an older file's spread_percent), seeds: int, "
                f"bits_per_element: int (optional), kappa: number (optional, with kappa_low and kappa_high: number "
                f"or null), r: number (optional, with r_half_width: number or null, r_seeds: int)}}: {cell}"
            )
        if has_half_width:
            half_width = cell["half_width_percent"]
        else:
            spread = cell["spread_percent"]
            half_width = None if spread is None else half_width_of(spread / 2.0, cell["seeds"])
        cells.append(
            StudyCell(
                mode=cell["mode"],
                workers=cell["workers"],
                beta2=cell["beta2"],
                gap_percent=cell["gap_percent"],
                half_width_percent=half_width,
                seeds=cell["seeds"],
                bits_per_element=cell.get("bits_per_element"),
                kappa=_kappa(cell),
                measured_ratio=_measured(cell),
            )
        )
    return tuple(cells)


def with_job_cells(cells: tuple[StudyCell, ...], job_cells: tuple[StudyCell, ...]) -> tuple[StudyCell, ...]:
    """``cells`` with ``job_cells`` (measured on the job's own task: ``python -m ds_lioncub.simulate
    --evidence-out``) in place of the cell of the same mode, worker count and beta2, and added where there is
    none: the job's own measurement is the better evidence for its mode, the study's stays for the rest."""
    mine = {(cell.mode, cell.workers, cell.beta2) for cell in job_cells}
    kept = tuple(cell for cell in cells if (cell.mode, cell.workers, cell.beta2) not in mine)
    return kept + tuple(replace(cell, job=True) for cell in job_cells)


@cache
def load_evidence() -> tuple[StudyCell, ...]:
    """The cells of the study shipped with ds_lioncub (none when it has not been summarised yet)."""
    return read_evidence(EVIDENCE_FILE) if EVIDENCE_FILE.exists() else ()


__all__ = [
    "EVIDENCE_FILE",
    "LOSS_THRESHOLD_PERCENT",
    "MIN_SEEDS",
    "SHIPPED_STUDY",
    "StudyCell",
    "load_evidence",
    "read_evidence",
    "with_job_cells",
]
