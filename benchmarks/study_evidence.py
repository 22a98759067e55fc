"""The convergence study's summary for the planner: ``ds_lioncub/planner/convergence_evidence.json``.

One job: from a study directory's runs (read and summarised by benchmarks/study_report.py), the cells the
planner and ``compression="auto"`` read (:func:`evidence`: per mode key, worker count and beta2, the gap to
exact Lion, its interval, the seeds and the mode's bits per element), and the merge of a sharper study's
points into an existing summary (:func:`merge_evidence`). ``python -m benchmarks.study_convergence --evidence FILE
[--evidence-base BASE]`` writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.study_report import load_runs, summarised_cells
from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.config import parse_config
from ds_lioncub.planner.convergence import study_mode
from ds_lioncub.student_t import MeanInterval


def bits_per_element(params: dict[str, Any], workers: int) -> int:
    """Bits per gradient element of the message each of ``workers`` ranks sends for LionCub ``params``: 1 for the
    1-bit vote, b for a b-bit vote. Counted by ds_lioncub.comm.wire (what the transports and the planner count)
    on a bucket of 8 x ``workers`` elements, which needs no padding.

    Momentum sync (docs/design.md, section 8) is not in the figure: every ``interval`` K steps it all-reduces
    the selected layers' momenta, 2(p - 1)/p x 32 bits (fp32; 16 in bf16) per selected element, so it adds
    2(p - 1)/p x 32 x (n_sel / n) / K bits per element per step on average, with n_sel / n the share of the
    model's elements in the embeddings and head (``layers: "auto"``), which depends on the model.
    """
    options = parse_config(params)
    numel = wire.vote_padded_numel(1, workers)
    if options.compression == "1bit":
        message = wire.sign_vote_message_bytes(numel, workers)
    elif options.compression == "kbit":
        codec = KbitCodec.build(workers, options.bits, options.quantizer, options.kbit_algorithm)
        message = wire.kbit_message_bytes(codec, numel)
    else:
        raise ValueError(f"bits_per_element: {options.compression!r} sends no vote")
    return 8 * message // numel


def evidence(directory: Path, workers: list[int], modes: list[str], beta2s: list[float]) -> dict[str, Any]:
    """The study's summary for the planner and ``compression="auto"`` (ds_lioncub/planner/convergence.py):
    one cell per (planner mode key, workers, beta2) with the gap's mean, the half-width of its 95% Student-t
    interval (both in %), the seeds, and the mode's bits per element (:func:`bits_per_element`).

    The planner's key comes from each run's own options (``study_mode``); two study modes with the same
    key (the 4-bit sign vote is the 1-bit vote's arithmetic) give one cell, the first in ``modes``, and the
    bits are those of the mode the key names (1 for a vote of sign fields, the 1-bit vote's key).
    """
    cells = load_runs(directory)
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
        out.append(
            {
                "mode": key,
                "workers": n,
                "beta2": beta2,
                "gap_percent": round(gap.mean, 3),
                "half_width_percent": None if gap.half_width is None else round(gap.half_width, 3),
                "seeds": len(row["seeds"]),
                "bits_per_element": bits_per_element(voted, n),
            }
        )
    return {
        # The root's name too: the first study and the pinned corpus's both hold a gpt-small_300steps.
        "source": f"benchmarks/study_convergence.py, results {directory.parent.name}/{directory.name} "
        "(benchmarks/RESULTS.md)",
        "cells": out,
    }


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
    return {"source": f"{newer['source']}; other cells: {base['source']}", "cells": cells}
