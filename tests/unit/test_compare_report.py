"""examples/compare_report.py: the planner predictions examples.compare prints, and its loss plot (no DeepSpeed).

The expected figures come from ds_lioncub.planner.plan, called here with each configuration's
candidate picked out by its params as written by hand; what is checked is that the report asks the
planner about the right configurations, cluster and links, and prints its answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ds_lioncub import planner
from examples import compare_report
from examples.compare_report import RunConfig

RUNS = [
    RunConfig("lion_fp32", "Lion, fp32 all-reduce", {"compression": "none"}),
    RunConfig("lioncub_1bit", "Lion Cub 1-bit vote", {"compression": "1bit"}),
    RunConfig("lioncub_4bit_sign", "Lion Cub 4-bit sign", {"compression": "kbit", "bits": 4, "quantizer": "sign"}),
]
# The planner's own params for the same three modes at ZeRO stage 0.
PLANNER_PARAMS = [
    {"compression": "none"},
    {"compression": "1bit"},
    {"compression": "kbit", "bits": 4, "quantizer": "sign", "kbit_algorithm": "allreduce"},
]


def _stage0(candidates: list[planner.Candidate], params: dict[str, Any]) -> planner.Candidate:
    (found,) = [c for c in candidates if c.zero_stage == 0 and c.params == params]
    return found


def test_communication_params_from_a_run_summary() -> None:
    summary = {
        "optimizer_params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, "compression": "kbit", "bits": 8},
        "ds_config": {"train_micro_batch_size_per_gpu": 16},
    }
    assert compare_report.communication_params(summary) == {"compression": "kbit", "bits": 8}
    exact = {"optimizer_params": {"lr": 1e-3, "compression": "none"}, "ds_config": {}}
    assert compare_report.communication_params(exact) == {"compression": "none", "comm_dtype": "fp32"}
    bf16 = {"optimizer_params": {"compression": "none"}, "ds_config": {"communication_data_type": "bf16"}}
    assert compare_report.communication_params(bf16) == {"compression": "none", "comm_dtype": "bf16"}


def test_prediction_rows_are_the_planners_stage0_candidates() -> None:
    num_params = 467_584
    rows = compare_report.prediction_rows(RUNS, num_params, nodes=2, gpus_per_node=1, link_rates=("1gbit", "10gbit"))
    assert [(r.link, r.config) for r in rows] == [
        (link, run.name) for link in ("1 Gbit/s", "10 Gbit/s") for run in RUNS
    ]
    for rate, chunk in (("1gbit", rows[:3]), ("10gbit", rows[3:])):
        network = planner.Network(inter_node_bandwidth=planner.parse_rate(rate))
        candidates = planner.plan(num_params, planner.Cluster(nodes=2, gpus_per_node=1), network)
        for row, params in zip(chunk, PLANNER_PARAMS, strict=True):
            expected = _stage0(candidates, params)
            assert row.bytes_per_step_per_rank == expected.bytes_per_step_per_rank
            assert row.comm_s == expected.comm_seconds
            assert row.local_s == expected.local_seconds
            assert row.step_s == expected.seconds_per_step
            assert row.note == ""

    table = compare_report.format_prediction_table(rows, "lion_fp32")
    lion, one_bit = rows[0], rows[1]
    assert lion.step_s is not None and one_bit.step_s is not None
    line = next(text for text in table.splitlines() if text.startswith("lioncub_1bit       1 Gbit/s"))
    assert line.endswith(f"{lion.step_s / one_bit.step_s:.1f}x")
    assert f"{one_bit.bytes_per_step_per_rank:,}" in line


def test_large_model_rows_are_communication_only_and_say_what_cannot_run() -> None:
    cluster = planner.Cluster(nodes=4, gpus_per_node=8)
    rows = compare_report.prediction_rows(
        RUNS, 1_300_000_000, 4, 8, link_rates=("100gbit",), intra_node_rate="100GB/s", local_work=False
    )
    network = planner.Network(inter_node_bandwidth=100e9 / 8, intra_node_bandwidth=100e9)
    candidates = planner.plan(1_300_000_000, cluster, network)
    for row, params in zip(rows[:2], PLANNER_PARAMS[:2], strict=True):
        expected = _stage0(candidates, params)
        assert row.comm_s == pytest.approx(expected.comm_seconds)
        assert row.step_s == pytest.approx(expected.comm_seconds)  # no local work in these rows
        assert row.local_s is None
    # 32 ranks: a 4-bit sign all-reduce holds at most 2**4 - 1 = 15 voters.
    assert rows[2].step_s is None and rows[2].bytes_per_step_per_rank is None
    assert "at most 15 ranks" in rows[2].note
    assert "cannot run: a 4-bit sign all-reduce holds at most 15 ranks" in compare_report.format_prediction_table(
        rows, "lion_fp32"
    )


def test_prediction_report_is_labelled_as_predictions() -> None:
    text = compare_report.prediction_report(RUNS, 467_584, 2)
    assert text.startswith("PLANNER PREDICTIONS") and "NOT measurements" in text and "loopback" in text
    assert "This model (467,584 params) on 2 machines" in text and "1.3B-parameter model on 4 nodes x 8 GPUs" in text
    assert sum(line.startswith("lion_fp32 ") for line in text.splitlines()) == 2 * len(compare_report.LINK_RATES)


# matplotlib's default colour cycle: curve i is drawn in CYCLE[i].
CYCLE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def _colours_present(path: Path) -> list[bool]:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))[..., :3]
    present = []
    for colour in CYCLE:
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        close = (abs(pixels - rgb) < 0.02).all(axis=-1)
        present.append(int(close.sum()) > 50)
    return present


def test_trailing_mean() -> None:
    assert compare_report.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert compare_report.trailing_mean([3.0, 6.0, 0.0], 10) == [3.0, 4.5, 3.0]


def test_loss_plot_has_one_curve_per_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the loss plot needs matplotlib (setup.py's bench extra)")
    runs = [(f"run {i}", [5.0 - 0.01 * step - 0.3 * i for step in range(150)]) for i in range(4)]
    path = compare_report.write_loss_plot(runs, tmp_path / "plots" / "loss.png", "test")
    assert path == tmp_path / "plots" / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _colours_present(path) == [True, True, True, True, False, False]
