"""What the convergence study says about a mode at a worker count and beta2: does it keep Lion's loss?

The study (benchmarks/study_convergence.py, benchmarks/RESULTS.md "Convergence at 4-64 workers")
trains the example GPT in the virtual world (:mod:`ds_lioncub.simulate`) at 4-64 workers with each
mode and with exact Lion, over several seeds, and records each mode's validation loss relative to
exact Lion's at the same worker count (the gap, in %) with its seed spread. Its summary ships as
``convergence_evidence.json`` beside this module, and this module reads it for the planner and
``compression="auto"``:

- a mode *loses* at N workers and beta2 when the study measured its gap above
  :data:`LOSS_THRESHOLD_PERCENT` (2%) and beyond its seed spread (a real gap, not seed noise), over at
  least :data:`MIN_SEEDS` seeds (a cell of fewer is shown, with its seed count, but never loses);
- the planner never recommends a losing mode without saying so, and ``"auto"`` skips it for the
  fastest mode that does not lose (exact Lion at worst, which loses nothing by definition).

Worker counts between the study's points take the next measured count above (more workers never
made a vote more faithful in the study); beyond the largest, the largest, and the verdict says so.
beta2 takes the nearest studied value. A k-bit vote of sign fields is the 1-bit vote's arithmetic
(the sum of the workers' signs, the same tie rule; tests/unit/test_virtual_world.py shows them
bit-identical), so it takes the 1-bit vote's evidence. The study ran the default tie rule and L1
clip; other settings of them take the same evidence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ds_lioncub.planner.model import Candidate, Cluster

#: A mode that loses more than this much of exact Lion's validation loss (in %) is not recommended silently.
LOSS_THRESHOLD_PERCENT = 2.0
#: Seeds a cell needs before its gap can count as a loss: a spread from fewer says too little.
MIN_SEEDS = 3
EVIDENCE_FILE = Path(__file__).with_name("convergence_evidence.json")


@dataclass(frozen=True)
class StudyCell:
    """One (mode, workers, beta2) of the study.

    Attributes:
        mode: the study's mode key (:func:`study_mode`).
        workers: N, the data-parallel workers (voters).
        beta2: Lion's beta2.
        gap_percent: mean over seeds of (mode's val loss - exact Lion's) / exact Lion's, in %.
        spread_percent: twice the sample standard deviation of the per-seed gaps; None with one seed.
        seeds: how many seeds the mean is over.
    """

    mode: str
    workers: int
    beta2: float
    gap_percent: float
    spread_percent: float | None
    seeds: int

    @property
    def loses(self) -> bool:
        """A real gap (beyond the seed spread of at least :data:`MIN_SEEDS` seeds) above the threshold."""
        return (
            self.seeds >= MIN_SEEDS
            and self.spread_percent is not None
            and self.gap_percent > LOSS_THRESHOLD_PERCENT
            and self.gap_percent > self.spread_percent
        )


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
    if compression == "1bit" or (params.get("quantizer", "sign") == "sign" and voted):
        return "1bit+sync" if synced else "1bit"
    if params.get("quantizer") == "l1" and voted:
        return f"{params.get('bits', 4)}bit-l1-{params.get('kbit_algorithm', 'allreduce')}"
    return "unmeasured"


def read_evidence(path: str | Path) -> tuple[StudyCell, ...]:
    """The cells of a study summary file (``{"cells": [{mode, workers, beta2, gap_percent, spread_percent,
    seeds}, ...]}``, what benchmarks/study_convergence.py --report --evidence writes); raises ValueError
    naming the first malformed cell."""
    data = json.loads(Path(path).read_text())
    cells = []
    for index, cell in enumerate(data["cells"]):
        spread = cell.get("spread_percent")
        well_formed = (
            isinstance(cell.get("mode"), str)
            and type(cell.get("workers")) is int
            and type(cell.get("seeds")) is int
            and all(type(cell.get(key)) in (int, float) for key in ("beta2", "gap_percent"))
            and (spread is None or type(spread) in (int, float))
        )
        if not well_formed:
            raise ValueError(
                f"cell {index} of {path} is not {{mode: str, workers: int, beta2: number, gap_percent: number, "
                f"spread_percent: number or null, seeds: int}}: {cell}"
            )
        cells.append(StudyCell(**cell))
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
    if not mine:
        return Verdict(None, "not in the convergence study")
    nearest_beta2 = min({cell.beta2 for cell in mine}, key=lambda b: abs(b - beta2))
    at_beta2 = sorted((cell for cell in mine if cell.beta2 == nearest_beta2), key=lambda cell: cell.workers)
    above = [cell for cell in at_beta2 if cell.workers >= workers]
    cell = above[0] if above else at_beta2[-1]
    where = f"{cell.workers} workers" + ("" if above else f", the study's largest (you have {workers})")
    spread = "n/a" if cell.spread_percent is None else f"{cell.spread_percent:.1f}"
    note = f"{cell.gap_percent:+.1f}% ± {spread} vs Lion's loss ({where}, beta2 {cell.beta2}, {cell.seeds} seeds)"
    return Verdict(cell, note)


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
        skipped: faster candidates the study shows losing, fastest first, with their verdicts.
        verdicts: every candidate's verdict, in the candidates' order.
    """

    best: Candidate
    skipped: tuple[tuple[Candidate, Verdict], ...]
    verdicts: tuple[Verdict, ...]

    def skipped_sentence(self) -> str:
        """Why faster candidates were passed over ("" when none was)."""
        if not self.skipped:
            return ""
        reasons = "; ".join(f"{c.label}: {verdict.note}" for c, verdict in self.skipped)
        return (
            f"Faster but not recommended, the convergence study shows them losing more than "
            f"{LOSS_THRESHOLD_PERCENT:g}% of Lion's loss: {reasons} (benchmarks/RESULTS.md, "
            f"'Convergence at 4-64 workers')."
        )


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
            return Choice(candidate, tuple(skipped), verdicts)
        skipped.append((candidate, verdict))
    raise ValueError("choose: no candidate keeps Lion's loss (exact Lion always does; was it left out?)")


__all__ = [
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
