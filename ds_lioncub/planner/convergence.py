"""What the convergence study says about a mode at a worker count and beta2: does it keep Lion's loss?

The study (benchmarks/study_convergence.py, benchmarks/RESULTS.md "Convergence at 4-64 workers")
trains the example GPT in the virtual world (:mod:`ds_lioncub.simulate`) at 4-64 workers with each
mode and with exact Lion, over several seeds, and records each mode's validation loss relative to
exact Lion's at the same worker count (the gap, in %): the mean over seeds and the half-width of its
two-sided 95% Student-t interval (:mod:`ds_lioncub.student_t`). Its summary ships as
``convergence_evidence.json`` beside this module, and this module reads it for the planner and
``compression="auto"``:

- a mode *loses* at N workers and beta2 only on evidence of harm: the interval's lower end (gap -
  half-width) above :data:`LOSS_THRESHOLD_PERCENT` (2%), over at least :data:`MIN_SEEDS` seeds (a
  cell of fewer is shown, with its seed count, but never loses);
- the planner never recommends a losing mode without saying so, and ``"auto"`` skips it for the
  fastest mode that does not lose (exact Lion at worst, which loses nothing by definition);
- where the interval is too wide to tell (its upper end reaches 2%, its lower end does not pass it),
  the mode is recommended on speed as usual and the interval is printed beside the recommendation
  (:meth:`Choice.caveat`): the study does not show it losing, nor keeping within 2%.

Worker counts between the study's points take the next measured count above (more workers never
made a vote more faithful in the study); beyond the largest, the largest, and the verdict says so.
beta2 takes the nearest studied value. A k-bit vote of sign fields is the 1-bit vote's arithmetic
(the sum of the workers' signs, the same tie rule; tests/unit/test_virtual_world.py shows them
bit-identical), so it takes the 1-bit vote's evidence. The study ran the default tie rule and L1
clip; other settings of them take the same evidence. A mode with option ``clip`` (the mean gradient's
sketched norm in place of DeepSpeed's per-rank clipping, the default under DeepSpeed since 0.2.0) has cells of
its own (``"1bit+clip"``), whatever its max_norm and sketch width; a mode that keeps DeepSpeed's rule
(``{"rule": "deepspeed"}``) has the plain ones (``"1bit"``); where the study has none for the mode, it takes the
mode's cells without clip (and says so): clip fixes the clipping, not what the mode's own arithmetic loses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ds_lioncub.planner.model import Candidate, Cluster
from ds_lioncub.student_t import half_width_of

#: A mode that loses more than this much of exact Lion's validation loss (in %) is not recommended silently.
LOSS_THRESHOLD_PERCENT = 2.0
#: Seeds a cell needs before its gap can count as a loss: an interval from fewer says too little.
MIN_SEEDS = 3
EVIDENCE_FILE = Path(__file__).with_name("convergence_evidence.json")
#: What a mode's study key adds with option clip (``"1bit+clip"``).
CLIP_SUFFIX = "+clip"


@dataclass(frozen=True)
class StudyCell:
    """One (mode, workers, beta2) of the study.

    Attributes:
        mode: the study's mode key (:func:`study_mode`).
        workers: N, the data-parallel workers (voters).
        beta2: Lion's beta2.
        gap_percent: mean over seeds of (mode's val loss - exact Lion's) / exact Lion's, in %.
        half_width_percent: half-width of the mean's two-sided 95% Student-t interval (t(seeds - 1) x the
            per-seed gaps' sample sd / sqrt(seeds)), in points of %; None with one seed.
        seeds: how many seeds the mean is over.
        bits_per_element: the mode's bits per gradient element in each rank's message (1 for the 1-bit vote
            and its momentum-sync form, b for a b-bit vote); None where the file does not say.
    """

    mode: str
    workers: int
    beta2: float
    gap_percent: float
    half_width_percent: float | None
    seeds: int
    bits_per_element: int | None = None

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
        """Evidence of harm: the interval's lower end above the threshold, over at least :data:`MIN_SEEDS` seeds."""
        return self.seeds >= MIN_SEEDS and self.low is not None and self.low > LOSS_THRESHOLD_PERCENT

    @property
    def undecided(self) -> bool:
        """The study does not show the mode losing, nor keeping within the threshold: the interval's upper end
        reaches the threshold, or there is no interval (one seed). A cell of fewer than :data:`MIN_SEEDS` seeds
        whose whole interval lies above the threshold is undecided too: it never loses."""
        return not self.loses and (self.high is None or self.high >= LOSS_THRESHOLD_PERCENT)

    def interval_text(self) -> str:
        """``"+3.3% (95% CI +0.3 to +6.3, 3 seeds)"``; ``"+1.0% (1 seed, no interval)"``."""
        if self.low is None or self.high is None:
            return f"{self.gap_percent:+.1f}% ({self.seeds} seed{'s' if self.seeds != 1 else ''}, no interval)"
        return f"{self.gap_percent:+.1f}% (95% CI {self.low:+.1f} to {self.high:+.1f}, {self.seeds} seeds)"


@dataclass(frozen=True)
class Verdict:
    """What the study says about one candidate.

    Attributes:
        cell: the study cell it rests on (None: exact Lion, or a mode the study did not measure).
        note: the verdict in words, for tables and logs.
    """

    cell: StudyCell | None
    note: str

    @property
    def loses(self) -> bool:
        return self.cell is not None and self.cell.loses


def study_mode(params: Mapping[str, Any]) -> str | None:
    """The study's key for LionCub params (None for exact Lion); ``"unmeasured"`` for a mode it has no cell for."""
    compression = params.get("compression", "1bit")
    if compression == "none":
        return None
    if params.get("error_feedback"):  # the study measured error feedback apart, not as planner evidence
        return "unmeasured"
    sync = params.get("momentum_sync") or {}
    synced = bool(sync.get("interval")) and sync.get("layers", "auto") == "auto" and int(sync["interval"]) <= 10
    voted = params.get("aggregation", "vote") == "vote"
    # Option clip changes what the workers' updates are made of (the mean gradient's norm clips them): its own cells.
    clip = params.get("clip")
    clipped = CLIP_SUFFIX if clip and clip.get("rule", "mean") == "mean" else ""
    if compression == "1bit" or (params.get("quantizer", "sign") == "sign" and voted):
        return ("1bit+sync" if synced else "1bit") + clipped
    if params.get("quantizer") == "l1" and voted:
        return f"{params.get('bits', 4)}bit-l1-{params.get('kbit_algorithm', 'allreduce')}{clipped}"
    return "unmeasured"


def _number_or_null(value: Any) -> bool:
    return value is None or type(value) in (int, float)


def read_evidence(path: str | Path) -> tuple[StudyCell, ...]:
    """The cells of a study summary file (``{"cells": [{mode, workers, beta2, gap_percent, half_width_percent,
    seeds, bits_per_element}, ...]}``, what benchmarks/study_convergence.py --evidence writes);
    raises ValueError naming the first malformed cell.

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
            and all(type(cell.get(key)) in (int, float) for key in ("beta2", "gap_percent"))
            and (has_half_width or "spread_percent" in cell)
            and _number_or_null(cell.get("half_width_percent" if has_half_width else "spread_percent"))
            and (cell.get("bits_per_element") is None or type(cell["bits_per_element"]) is int)
        )
        if not well_formed:
            raise ValueError(
                f"cell {index} of {path} is not {{mode: str, workers: int, beta2: number, gap_percent: number, "
                f"half_width_percent: number or null (or an older file's spread_percent), seeds: int, "
                f"bits_per_element: int (optional)}}: {cell}"
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
            )
        )
    return tuple(cells)


@cache
def load_evidence() -> tuple[StudyCell, ...]:
    """The cells of the study shipped with ds_lioncub (none when it has not been summarised yet)."""
    return read_evidence(EVIDENCE_FILE) if EVIDENCE_FILE.exists() else ()


def assess(
    params: Mapping[str, Any], workers: int, beta2: float, cells: tuple[StudyCell, ...] | None = None
) -> Verdict:
    """The study's verdict on LionCub ``params`` voting over ``workers`` workers at ``beta2``."""
    cells = load_evidence() if cells is None else cells
    mode = study_mode(params)
    if mode is None:
        return Verdict(None, "exact Lion")
    mine = [cell for cell in cells if cell.mode == mode]
    unclipped = ""
    if not mine and mode.endswith(CLIP_SUFFIX):
        # Not measured with option clip: the mode's cells without it, the evidence there is (clip fixes how the
        # workers' gradients are clipped, not what a mode's arithmetic loses, e.g. 2-bit L1's tied votes).
        mode = mode.removesuffix(CLIP_SUFFIX)
        mine = [cell for cell in cells if cell.mode == mode]
        unclipped = ", measured without option clip"
    if not mine:
        return Verdict(None, "not in the convergence study")
    nearest_beta2 = min({cell.beta2 for cell in mine}, key=lambda b: abs(b - beta2))
    at_beta2 = sorted((cell for cell in mine if cell.beta2 == nearest_beta2), key=lambda cell: cell.workers)
    above = [cell for cell in at_beta2 if cell.workers >= workers]
    cell = above[0] if above else at_beta2[-1]
    where = f"{cell.workers} workers" + ("" if above else f", the study's largest (you have {workers})")
    return Verdict(cell, f"loss vs Lion {cell.interval_text()} at {where}, beta2 {cell.beta2}{unclipped}")


def voters(candidate: Candidate, cluster: Cluster) -> int:
    """The workers whose updates ``candidate`` votes over: the nodes under a ZeRO hybrid, else every rank."""
    if candidate.compression != "none" and candidate.zero_stage in (1, 2, 3):
        return cluster.nodes
    return cluster.nodes * cluster.gpus_per_node


@dataclass(frozen=True)
class Choice:
    """The planner's recommendation once convergence is taken into account.

    Attributes:
        best: the fastest candidate the study does not show losing more than the threshold.
        best_verdict: the study's verdict on ``best``.
        skipped: faster candidates the study shows losing, fastest first, with their verdicts.
        verdicts: every candidate's verdict, in the candidates' order.
    """

    best: Candidate
    best_verdict: Verdict
    skipped: tuple[tuple[Candidate, Verdict], ...]
    verdicts: tuple[Verdict, ...]

    def skipped_sentence(self) -> str:
        """Why faster candidates were passed over ("" when none was)."""
        if not self.skipped:
            return ""
        reasons = "; ".join(f"{c.label}: {verdict.note}" for c, verdict in self.skipped)
        return (
            f"Faster but not recommended, the convergence study shows them losing more than "
            f"{LOSS_THRESHOLD_PERCENT:g}% of Lion's loss (the 95% interval above it): {reasons} "
            f"(benchmarks/RESULTS.md, 'Convergence at 4-64 workers')."
        )

    def caveat(self) -> str:
        """The recommendation's interval where the study cannot tell it keeps within the threshold ("" elsewhere):
        it is recommended on speed, and the user sees how uncertain its loss is."""
        cell = self.best_verdict.cell
        if cell is None or not cell.undecided:
            return ""
        if cell.seeds < MIN_SEEDS:
            why = f"{cell.seeds} seed{'s' if cell.seeds != 1 else ''}, too few to call a loss"
        else:
            why = f"not shown to exceed {LOSS_THRESHOLD_PERCENT:g}%, nor to stay below it"
        return f"{self.best.label}: {self.best_verdict.note}: {why}."


def choose(
    candidates: Sequence[Candidate],
    cluster: Cluster,
    beta2: float,
    cells: tuple[StudyCell, ...] | None = None,
    momentum_sync: Mapping[str, Any] | None = None,
) -> Choice:
    """The fastest of ``candidates`` (fastest first) that keeps Lion's loss, and what was passed over.

    ``momentum_sync``: the user's block (``compression="auto"`` keeps it on whichever compressed mode it
    picks), so that a compressed candidate is judged as it would run.
    """
    sync = {} if momentum_sync is None else {"momentum_sync": dict(momentum_sync)}
    verdicts = tuple(
        assess({**c.params, **(sync if c.compression != "none" else {})}, voters(c, cluster), beta2, cells)
        for c in candidates
    )
    skipped: list[tuple[Candidate, Verdict]] = []
    for candidate, verdict in zip(candidates, verdicts, strict=True):
        if not verdict.loses:
            return Choice(candidate, verdict, tuple(skipped), verdicts)
        skipped.append((candidate, verdict))
    raise ValueError("choose: no candidate keeps Lion's loss (exact Lion always does; was it left out?)")


__all__ = [
    "CLIP_SUFFIX",
    "EVIDENCE_FILE",
    "LOSS_THRESHOLD_PERCENT",
    "MIN_SEEDS",
    "Choice",
    "StudyCell",
    "Verdict",
    "assess",
    "choose",
    "load_evidence",
    "read_evidence",
    "study_mode",
    "voters",
]
