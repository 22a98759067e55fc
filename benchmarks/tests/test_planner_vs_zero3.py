"""planner_vs_zero3's bookkeeping on the committed ZeRO-3 results: the step means and the compute floor it
reads, against means taken here from the per-step columns, and the rows it prints."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import planner_vs_zero3


def per_step(run: str, method: str, column: str) -> list[float]:
    path = planner_vs_zero3.RESULTS / run / f"{method}.json"
    values: list[float] = json.loads(path.read_text())["per_step"][column]
    return values


def test_the_means_are_those_of_the_sections_tables() -> None:
    # benchmarks/RESULTS.md, "ZeRO-3 hybrid on an emulated 2 x 2 cluster": total 2367 and 1662 ms (run 1).
    run = "train_zero3_hybrid_1gbit"
    for method, total_ms in (("lion_zero3", 2367), ("lioncub_1bit_zero3_hybrid", 1662)):
        result = planner_vs_zero3.load(run, method)
        assert round(planner_vs_zero3.mean(result, "total_s") * 1e3) == total_ms
    # Steps 1-3 left out, as the section's tables do.
    assert planner_vs_zero3.mean(planner_vs_zero3.load(run, "lion_zero3"), "tx_bytes") == pytest.approx(
        statistics.fmean(per_step(run, "lion_zero3", "tx_bytes")[3:])
    )


def test_the_table_has_a_row_per_run_and_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert planner_vs_zero3.main(["--intra-node-bandwidth", "1gbit"]) == 0
    text = capsys.readouterr().out
    # Run 1's stage-0 forward 164 ms + backward 296 ms (the section's table).
    assert "460 ms" in text.splitlines()[0]
    rows = [line for line in text.splitlines() if line.startswith(("| 1 Gbit/s |", "| 250 Mbit/s |"))]
    assert len(rows) == 4
    # The hand counts (tests/unit/test_planner_zero3.py): 3 x 3 x 3,228,800 x 4 / 2 and 2 x (807,200 + 4) / 2.
    assert text.count("| 58,118,400 |") == 2 and text.count("| 807,204 |") == 2
    assert "measured 1.42x" in text and "measured 3.50x" in text
