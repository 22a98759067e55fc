"""planner_vs_zero3's bookkeeping on the committed ZeRO-3 results: the step means and the compute floor it
reads, against means taken here from the per-step columns, and the rows it prints."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import planner_vs_zero3
from ds_lioncub.planner import Cluster, Network, plan
from ds_lioncub.planner.devices import local_costs_for

GPT_PARAMS = 12_915_200  # the benchmark GPT (RESULTS.md: "12,915,200 parameters")


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
    # The hand counts (tests/unit/test_planner_zero3.py): 3 x 3 x 3,228,800 x 4 / 2 and 2 x (807,200 + 4) / 2, the
    # hybrid without the noise scale's sketch, which the recorded runs predate.
    assert text.count("| 58,118,400 |") == 2 and text.count("| 807,204 |") == 2
    assert "measured 1.42x" in text and "measured 3.50x" in text


def test_the_hybrid_is_the_planners_without_the_noise_scales_sketch() -> None:
    """The table prices the runs as they ran: plan()'s 1-bit ZeRO-3 hybrid, which pays the noise scale's sketch
    (4093 fp64 bins + the squared norm, all-reduced inside the node, then by each of the 2 vote groups across the 2
    nodes), less exactly that sketch's bytes; exact ZeRO-3 the planner's own."""
    n, network = GPT_PARAMS, Network(1e9 / 8, 1e9 / 8)
    costs = local_costs_for("cpu", None, None)
    recorded = planner_vs_zero3.recorded_candidates(n, network, costs)
    planned = plan(n, Cluster(2, 2), network, costs, zero_stages=(3,), ranks_per_core=planner_vs_zero3.RANKS_PER_CORE)
    [exact] = [c for c in planned if c.params == {"compression": "none"}]
    [hybrid] = [c for c in planned if c.params == {"compression": "1bit", "hybrid": {"node_size": 2}}]
    assert recorded["lion_zero3"] == exact
    sketch = 2 * 8 * (4093 + 1) * (2 - 1) // 2  # one rank's ring all-reduce of the sketch over 2 ranks
    without = recorded["lioncub_1bit_zero3_hybrid"]
    assert without.label == hybrid.label and without.params["telemetry"] == {"noise_scale": False}
    assert without.bytes_per_step_per_rank == hybrid.bytes_per_step_per_rank - 2 * sketch  # in the node, across
    assert without.node_link_bytes_per_step == hybrid.node_link_bytes_per_step - 2 * sketch  # 2 groups across
    assert without.seconds_per_step < hybrid.seconds_per_step and without.local_seconds < hybrid.local_seconds
