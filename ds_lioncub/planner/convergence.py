"""What the convergence study says about a mode, and the planner's choice: the first to exact Lion's loss.

The study (benchmarks/study_convergence.py) trains the example GPT in the virtual world
(:mod:`ds_lioncub.simulate`) at 4-64 workers with each mode and with exact Lion, over several seeds, and
records each mode's validation loss relative to exact Lion's at the same worker count (the gap, in %): the
mean over seeds and the half-width of its two-sided 95% Student-t interval (:mod:`ds_lioncub.quantities.student_t`),
with, where measured, the share of the batch the mode is worth (kappa) and r, the steps it needs to reach
exact Lion's loss in units of exact Lion's. Its summary ships as ``convergence_evidence.json``
(:mod:`ds_lioncub.planner.evidence`), and this module reads it for the planner and ``compression="auto"``:

- every candidate's time to exact Lion's loss is its step time x r (:mod:`ds_lioncub.planner.time_to_loss`:
  r from the job's batch and noise scale and the mode's kappa, the worst case 1/kappa where the noise scale
  is not known, a measurement at the study's batch), and the candidate that reaches it first is recommended
  (:func:`choose`). A mode is passed over only for another that reaches the loss sooner, never for its gap
  after a fixed number of steps alone; the gap stays in the output, beside r;
- exact Lion has r = 1; a mode the study did not measure (or without a kappa) has no r and is ranked by its
  step time alone, which the output says.

Which cell judges a mode (:func:`assess`): the next studied worker count at or above the voters (more
workers never made a vote more faithful in the study); beyond the largest, the largest, and the verdict says
so. A mode and its form with option clip are judged at the same count: the counts where both were measured
(the study measured clip at 8-64 workers only, so at 4 voters clip's 8-worker cells would otherwise meet the
plain mode's 4-worker cells of another design and corpus). beta2 takes the nearest studied value, said
plainly where it is not the job's; kappa, measured at beta2 0.99 only, comes from the nearest beta2 that has
one. A k-bit vote of sign fields is the 1-bit vote's arithmetic (the sum of the workers' signs, the same tie
rule; tests/unit/test_virtual_world.py shows them bit-identical), so it takes the 1-bit vote's evidence. The
study ran the default tie rule and L1 clip; other settings of them take the same evidence. A mode with option
``clip`` (the mean gradient's sketched norm in place of DeepSpeed's per-rank clipping, the default under
DeepSpeed since 0.2.0) has cells of its own (``"1bit+clip"``), whatever its max_norm and sketch width; a mode
that keeps DeepSpeed's rule (``{"rule": "deepspeed"}``) has the plain ones (``"1bit"``); where the study has
none for the mode, it takes the mode's cells without clip (and says so): clip fixes the clipping, not what the
mode's own arithmetic loses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_lioncub.modes import mode_named
from ds_lioncub.modes.record import CLIP_SUFFIX
from ds_lioncub.planner.evidence import (
    EVIDENCE_FILE,
    LOSS_THRESHOLD_PERCENT,
    MIN_SEEDS,
    SHIPPED_STUDY,
    StudyCell,
    load_evidence,
    read_evidence,
)
from ds_lioncub.planner.model import Candidate, Cluster
from ds_lioncub.planner.time_to_loss import EXACT, JobBatch, StepsRatio, steps_ratio
from ds_lioncub.quantities.units import format_seconds


@dataclass(frozen=True)
class Verdict:
    """What the study says about one candidate.

    Attributes:
        cell: the study cell it rests on (None: exact Lion, or a mode the study did not measure).
        note: the verdict in words, for tables and logs.
        ratio_cell: the cell whose kappa and measured r give the candidate's r: ``cell``, or where ``cell`` has
            neither, the same mode's at the nearest beta2 that has them (None: no r).
        ratio_note: where ``ratio_cell`` is not ``cell``, how it was found ("" otherwise).
    """

    cell: StudyCell | None
    note: str
    ratio_cell: StudyCell | None = None
    ratio_note: str = ""

    @property
    def loses(self) -> bool:
        """The gap after the study's steps shown above the threshold (:attr:`StudyCell.loses`)."""
        return self.cell is not None and self.cell.loses


def study_mode(params: Mapping[str, Any]) -> str | None:
    """The study's key for LionCub params (None for exact Lion); ``"unmeasured"`` for a mode it has no cell for. Each
    mode's record names its cells (:attr:`ds_lioncub.modes.ModeRecord.study_key`)."""
    return mode_named(str(params.get("compression", "1bit"))).study_key(params)


def _pick(cells: Sequence[StudyCell], workers: int) -> tuple[StudyCell, bool]:
    """The cell at the next count at or above ``workers`` (True), else the largest (False); ``cells`` non-empty."""
    ordered = sorted(cells, key=lambda cell: cell.workers)
    above = [cell for cell in ordered if cell.workers >= workers]
    return (above[0], True) if above else (ordered[-1], False)


def _comparable(mine: Sequence[StudyCell], cells: Sequence[StudyCell], mode: str, beta2: float) -> list[StudyCell]:
    """``mine`` at ``beta2``, kept to the worker counts where the mode's twin with or without option clip was
    measured too (all of them where the two share none): so ``--clip`` and no clip judge at one count."""
    at_beta2 = [cell for cell in mine if cell.beta2 == beta2]
    twin = mode.removesuffix(CLIP_SUFFIX) if mode.endswith(CLIP_SUFFIX) else mode + CLIP_SUFFIX
    twin_counts = {cell.workers for cell in cells if cell.mode == twin and cell.beta2 == beta2}
    shared = [cell for cell in at_beta2 if cell.workers in twin_counts]
    return shared or at_beta2


def _ratio_cell(
    mine: Sequence[StudyCell], cells: Sequence[StudyCell], mode: str, cell: StudyCell, beta2: float, workers: int
) -> tuple[StudyCell | None, str]:
    """The cell whose kappa and measured r give r: ``cell`` where it has either; else, by the same worker-count
    rule, the same mode's cell that has one at the nearest beta2 (``cell``'s first), with a note saying which;
    (None, "") where none has."""

    def has_figures(c: StudyCell) -> bool:
        return c.kappa is not None or c.measured_ratio is not None

    if has_figures(cell):
        return cell, ""
    for other in sorted({c.beta2 for c in mine if has_figures(c)}, key=lambda b: (b != cell.beta2, abs(b - beta2))):
        at_other = [c for c in _comparable(mine, cells, mode, other) if has_figures(c)]
        if not at_other:
            continue
        found, _ = _pick(at_other, workers)
        if other == cell.beta2:
            return (
                found,
                f"{mode}: kappa from its {found.workers}-worker cell (its {cell.workers}-worker one has none)",
            )
        return found, f"kappa from beta2 {other}'s cells (the study has no batch share at beta2 {cell.beta2})"
    return None, ""


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
    own = [cell for cell in mine if cell.job and cell.workers == workers]
    if own:  # the job's own task at its own voters (--job-evidence): the best evidence there is
        cell = min(own, key=lambda c: abs(c.beta2 - beta2))
        note = f"loss vs Lion {cell.interval_text()} at {cell.workers} workers, beta2 {cell.beta2}, on your task"
        return Verdict(cell, note + unclipped, *_ratio_cell(mine, cells, mode, cell, beta2, workers))
    nearest_beta2 = min({cell.beta2 for cell in mine}, key=lambda b: abs(b - beta2))
    cell, above = _pick(_comparable(mine, cells, mode, nearest_beta2), workers)
    where = f"{cell.workers} workers" + ("" if above else f", the study's largest (you have {workers})")
    note = f"loss vs Lion {cell.interval_text()} at {where}, beta2 {cell.beta2}{unclipped}"
    ratio_cell, ratio_note = _ratio_cell(mine, cells, mode, cell, beta2, workers)
    return Verdict(cell, note, ratio_cell, ratio_note)


def voters(candidate: Candidate, cluster: Cluster) -> int:
    """The workers whose updates ``candidate`` votes over: the nodes under a ZeRO hybrid, else every rank."""
    if not candidate.exact and candidate.zero_stage in (1, 2, 3):
        return cluster.nodes
    return cluster.nodes * cluster.gpus_per_node


def candidate_ratio(candidate: Candidate, verdict: Verdict, job: JobBatch) -> StepsRatio:
    """r for ``candidate``: 1 for exact Lion; else from its verdict's ratio cell for ``job``."""
    if candidate.exact:
        return EXACT
    cell = verdict.ratio_cell
    if verdict.cell is None or cell is None:
        why = "not in the convergence study" if verdict.cell is None else "no batch share for this mode"
        return StepsRatio(1.0, None, None, "unknown", f"{why}: r unknown, ranked by its step time alone")
    where = f" at {cell.workers} workers, beta2 {cell.beta2}"
    found = steps_ratio(cell.kappa, cell.measured_ratio, job, where)
    extra = f"; {verdict.ratio_note}" if verdict.ratio_note else ""
    return StepsRatio(found.value, found.low, found.high, found.basis, found.note + extra)


def basis_text(job: JobBatch) -> str:
    """How r is found for ``job``: by the model at its B / B_noise, or the worst case where that is unknown."""
    ratio = job.ratio
    if ratio is None:
        return (
            "r: the worst case, 1/kappa (the job's noise scale is not known: give --noise-scale, LionCub.noise_scale "
            "in samples, with --global-batch)"
        )
    return (
        f"r: the model at B/B_noise = {ratio:.3g} (global batch {job.global_batch:g} samples, noise scale "
        f"{job.noise_scale:g} samples)"
    )


@dataclass(frozen=True)
class Choice:
    """The planner's recommendation: the candidate first to exact Lion's loss (step time x r).

    Attributes:
        best: the candidate with the least predicted time to exact Lion's loss.
        best_verdict: the study's verdict on ``best``.
        skipped: the candidates faster per step than ``best`` but later to the loss, fastest first, with verdicts.
        verdicts: every candidate's verdict, in the candidates' order.
        ratios: every candidate's r, in the candidates' order.
        candidates: the candidates, as given.
        job: the job's batch and noise scale r was found for.
        study: what the evidence is, in words.
        beta2: the job's beta2, which the verdicts judged.
        voter_counts: every candidate's voters (:func:`voters`), in the candidates' order.
    """

    best: Candidate
    best_verdict: Verdict
    skipped: tuple[tuple[Candidate, Verdict], ...]
    verdicts: tuple[Verdict, ...]
    ratios: tuple[StepsRatio, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    job: JobBatch = field(default_factory=JobBatch)
    study: str = f"the convergence study ({SHIPPED_STUDY})"
    beta2: float | None = None
    voter_counts: tuple[int, ...] = ()

    def ratio_of(self, candidate: Candidate) -> StepsRatio:
        return self.ratios[self.candidates.index(candidate)]

    def seconds_to_loss(self, candidate: Candidate) -> float:
        """The predicted time to exact Lion's loss: (the step + the job's compute per step) x r."""
        return (candidate.seconds_per_step + self.job.compute_seconds) * self.ratio_of(candidate).value

    def time_text(self, candidate: Candidate) -> str:
        """``"458 ms x r 1.49 [1.35, 1.65] = 683 ms [618 ms, 756 ms]"``; the step alone for exact Lion. The step
        includes the job's compute per step where given (:class:`~ds_lioncub.planner.time_to_loss.JobBatch`)."""
        ratio = self.ratio_of(candidate)
        step = candidate.seconds_per_step + self.job.compute_seconds
        if ratio.basis == "exact":
            return f"{format_seconds(step)} (exact Lion, r = 1)"
        if not ratio.known:
            return f"{format_seconds(step)} x r ? (r unknown)"
        interval = ""
        if ratio.low is not None and ratio.high is not None:
            interval = f" [{format_seconds(step * ratio.low)}, {format_seconds(step * ratio.high)}]"
        return f"{format_seconds(step)} x r {ratio.text()} = {format_seconds(step * ratio.value)}{interval}"

    def skipped_lines(self) -> list[str]:
        """Why faster candidates were passed over, one line each (none when none was)."""
        if not self.skipped:
            return []
        lines = [
            f"Faster per step but later to exact Lion's loss than {self.best.label} "
            f"({self.time_text(self.best)}); evidence: {self.study}:"
        ]
        lines += [f"  {c.label}: {self.time_text(c)}; {verdict.note}" for c, verdict in self.skipped]
        return lines

    def skipped_sentence(self) -> str:
        """:meth:`skipped_lines` in one sentence, for a log line ("" when none was passed over)."""
        if not self.skipped:
            return ""
        reasons = "; ".join(f"{c.label}: {self.time_text(c)}" for c, _ in self.skipped)
        return (
            f"Faster per step but later to exact Lion's loss (step x r, {basis_text(self.job).removeprefix('r: ')}; "
            f"evidence: {self.study}): {reasons}."
        )

    def study_notes(self) -> list[str]:
        """What the study's cells stand in for, said plainly: another beta2 than the job's, kappa from another
        beta2's cells (none when every verdict is at the job's beta2)."""
        notes = []
        judged = sorted({v.cell.beta2 for v in self.verdicts if v.cell is not None})
        if self.beta2 is not None and judged and judged != [self.beta2]:
            nearest = ", ".join(f"{b:g}" for b in judged)
            notes.append(
                f"beta2 {self.beta2:g} is not in the study: each mode is judged by its cells at the nearest beta2 the "
                f"study has for it ({nearest})."
            )
        notes += sorted({f"{v.ratio_note}." for v in self.verdicts if v.ratio_note})
        return notes

    def caveat(self) -> str:
        """The recommendation's gap interval where the study cannot tell it within the threshold ("" elsewhere):
        its loss after the study's steps, for the user to see (it decides nothing)."""
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
    job: JobBatch | None = None,
    study: str | None = None,
) -> Choice:
    """The candidate first to exact Lion's loss (least step time x r; of equal times the faster per step), and
    the faster ones it was chosen over.

    ``momentum_sync``: the user's block (``compression="auto"`` keeps it on whichever compressed mode it
    picks), so that a compressed candidate is judged as it would run. ``job``: the job's global batch and noise
    scale (default: neither known, the worst case r = 1/kappa). ``study``: what the evidence is, in words.
    """
    if not candidates:
        raise ValueError("choose: no candidates")
    job = JobBatch() if job is None else job
    sync = {} if momentum_sync is None else {"momentum_sync": dict(momentum_sync)}
    verdicts = tuple(
        assess({**c.params, **({} if c.exact else sync)}, voters(c, cluster), beta2, cells) for c in candidates
    )
    ratios = tuple(candidate_ratio(c, v, job) for c, v in zip(candidates, verdicts, strict=True))
    times = [(c.seconds_per_step + job.compute_seconds) * r.value for c, r in zip(candidates, ratios, strict=True)]
    index = min(range(len(candidates)), key=lambda i: (times[i], candidates[i].seconds_per_step, i))
    best = candidates[index]
    skipped = tuple(
        (c, v) for c, v in zip(candidates, verdicts, strict=True) if c.seconds_per_step < best.seconds_per_step
    )
    described = f"the convergence study ({SHIPPED_STUDY})" if study is None else study
    counts = tuple(voters(c, cluster) for c in candidates)
    return Choice(best, verdicts[index], skipped, verdicts, ratios, tuple(candidates), job, described, beta2, counts)


__all__ = [
    "CLIP_SUFFIX",
    "EVIDENCE_FILE",
    "LOSS_THRESHOLD_PERCENT",
    "MIN_SEEDS",
    "SHIPPED_STUDY",
    "Choice",
    "StudyCell",
    "Verdict",
    "assess",
    "basis_text",
    "candidate_ratio",
    "choose",
    "load_evidence",
    "read_evidence",
    "study_mode",
    "voters",
]
