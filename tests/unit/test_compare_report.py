"""examples/compare_report.py: the planner predictions examples.compare prints (no DeepSpeed).

The expected figures come from ds_lioncub.planner itself: ``plan`` called here with clusters, networks and
local cost tables built by hand, each configuration's candidate picked out by its params as written by hand,
and the planner's command line (``ds_lioncub.planner.cli.main``) run with the flags written out here. What is
checked is that the report asks the planner about the right configurations, cluster, device and links, and
prints its answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from ds_lioncub import planner
from ds_lioncub.planner import cli, default_local_costs, gpu_local_costs
from ds_lioncub.planner.pricing import CLIP_LOCAL_PASSES
from examples import compare_report
from examples.compare_report import PlannedCluster, RunConfig

RUNS = [
    RunConfig("lion_fp32", "Lion, fp32 all-reduce", {"compression": "none"}),
    RunConfig("lioncub_1bit", "Lion Cub 1-bit vote", {"compression": "1bit"}),
    RunConfig("lioncub_4bit_sign", "Lion Cub 4-bit sign", {"compression": "kbit", "bits": 4, "quantizer": "sign"}),
]
# The planner's own params for the same three modes at ZeRO stage 0: the compressed ones clip the mean gradient at
# the configs' gradient_clipping, 1.0 (what the command line plans by default).
CLIP = {"max_norm": 1.0}
PLANNER_PARAMS = [
    {"compression": "none"},
    {"compression": "1bit", "clip": CLIP},
    {"compression": "kbit", "bits": 4, "quantizer": "sign", "kbit_algorithm": "allreduce", "clip": CLIP},
]
# The large-model block's cluster as the planner's command line takes it, written out by hand.
LARGE_CLI = [
    "--params", "1.3e9", "--nodes", "4", "--gpus-per-node", "8", "--intra-node-bandwidth", "100GB/s",
    "--device", "cuda", "--gpu", "H100",
]  # fmt: skip
H100 = gpu_local_costs.SECONDS_PER_ELEMENT["H100"]


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
    rows = compare_report.prediction_rows(RUNS, PlannedCluster(num_params, 2, 1), link_rates=("1gbit", "10gbit"))
    assert [(r.link, r.config) for r in rows] == [
        (link, run.name) for link in ("1 Gbit/s", "10 Gbit/s") for run in RUNS
    ]
    for rate, chunk in (("1gbit", rows[:3]), ("10gbit", rows[3:])):
        # CPU ranks: the planner's defaults are the built-in CPU table and gloo's link efficiency.
        network = planner.Network(inter_node_bandwidth=planner.parse_rate(rate))
        candidates = planner.plan(num_params, planner.Cluster(nodes=2, gpus_per_node=1), network, clip=CLIP)
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


def test_large_model_rows_are_priced_with_the_h100_table_and_say_what_cannot_run() -> None:
    rows = compare_report.prediction_rows(RUNS, compare_report.large_model_cluster(), link_rates=("100gbit",))
    cluster = planner.Cluster(nodes=4, gpus_per_node=8)
    network = planner.Network(100e9 / 8, 100e9, efficiency=planner.LinkEfficiency(1.0, 1.0))
    h100 = planner.LocalCosts(H100, device="cuda")
    candidates = planner.plan(1_300_000_000, cluster, network, h100, clip=CLIP)
    for row, params in zip(rows[:2], PLANNER_PARAMS[:2], strict=True):
        expected = _stage0(candidates, params)
        assert row.comm_s == pytest.approx(expected.comm_seconds)
        assert row.local_s == pytest.approx(expected.local_seconds)
        assert row.step_s == pytest.approx(expected.seconds_per_step)
    # Local work from the measured table by hand: Lion's update on every parameter, plus the 1-bit vote's passes and
    # the clip's sketch (exact fp32 Lion: none, its sums are the all-reduce's own).
    assert rows[0].local_s == pytest.approx(H100["lion_update"] * 1_300_000_000)
    sketch = CLIP_LOCAL_PASSES["cuda"] * H100["lion_update"]
    assert rows[1].local_s == pytest.approx((H100["lion_update"] + H100["1bit"] + sketch) * 1_300_000_000)
    # 155 buckets: the 1-bit vote's local work hides behind its wire time, bar one bucket's share.
    comm, local, step = rows[1].comm_s, rows[1].local_s, rows[1].step_s
    assert comm is not None and local is not None and step is not None
    assert comm < step < comm + local
    # 32 ranks: a 4-bit sign all-reduce holds at most 2**4 - 1 = 15 voters.
    assert rows[2].step_s is None and rows[2].bytes_per_step_per_rank is None
    assert "at most 15 ranks" in rows[2].note
    assert "cannot run: a 4-bit sign all-reduce holds at most 15 ranks" in compare_report.format_prediction_table(
        rows, "lion_fp32"
    )


def _planner_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _seconds(text: str) -> float:
    """A duration as the planner's table prints it ("62.9 ms")."""
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]


def _block(text: str, heading: str) -> list[str]:
    """The lines of the report's block from the paragraph starting ``heading`` to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_large_model_block_matches_the_planner_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    text = compare_report.prediction_report(RUNS, 467_584, 2)
    block = _block(text, "A 1.3B-parameter model on 4 nodes x 8 GPUs")
    heading = " ".join(block[: next(i for i, line in enumerate(block) if line.startswith("config "))])
    assert "the planner's measured H100 table" in heading
    assert gpu_local_costs.MEASURED_ON["H100"] in heading
    assert "NCCL's link efficiency (1 in rings, 1 in all-to-alls)" in heading

    # The 1-bit row at 10 Gbit/s: config, link (2 words), bytes, comm ms, local ms, step ms, vs Lion.
    row = next(line for line in block if line.startswith("lioncub_1bit       10 Gbit/s"))
    _, _, _, sent, comm_ms, local_ms, step_ms, _ = row.split()
    as_json = json.loads(
        _planner_cli(capsys, *LARGE_CLI, "--inter-node-bandwidth", "10gbit", "--zero-stage", "0", "--json")
    )
    assert as_json["local_costs"] == {
        "device": "cuda",
        "measured_on": f"measured: {gpu_local_costs.MEASURED_ON['H100']}",
    }
    (one_bit,) = [c for c in as_json["candidates"] if c["params"] == {"compression": "1bit", "clip": CLIP}]
    assert int(sent.replace(",", "")) == one_bit["bytes_per_step_per_rank"]
    # The report prints ms to 2 decimals below 100 ms, whole ms above.
    assert float(step_ms.replace(",", "")) == pytest.approx(1e3 * one_bit["seconds_per_step"], abs=0.5)
    table = _planner_cli(capsys, *LARGE_CLI, "--inter-node-bandwidth", "10gbit", "--zero-stage", "0")
    cli_row = next(line for line in table.splitlines() if line.startswith("1-bit vote + clip "))
    cli_step, cli_comm, cli_local = re.findall(r"[\d.]+ m?s", cli_row)[:3]
    assert float(local_ms) == pytest.approx(1e3 * _seconds(cli_local), rel=5e-3)  # the CLI prints 3 digits
    assert float(comm_ms.replace(",", "")) == pytest.approx(1e3 * _seconds(cli_comm), rel=5e-3)
    sketch = CLIP_LOCAL_PASSES["cuda"] * H100["lion_update"]
    local = 1e3 * (H100["lion_update"] + H100["1bit"] + sketch) * 1.3e9
    assert float(local_ms) == pytest.approx(local, abs=0.005 if local < 100 else 0.5)

    # The recommendations, with and without --zero-stage 0, are the command line's.
    line = next(line for line in block if line.startswith("  10 Gbit/s "))
    for stage_flags, where in ((["--zero-stage", "0"], "stage 0"), ([], "stages 0 and 2")):
        output = _planner_cli(capsys, *LARGE_CLI, "--inter-node-bandwidth", "10gbit", *stage_flags)
        match = re.search(r"^Recommended: (.+), predicted (\S+ \S+) per step", output, re.MULTILINE)
        assert match is not None
        assert f"{where}: {match[1]} ({match[2]})" in line


def test_prediction_report_is_labelled_and_names_each_blocks_prices() -> None:
    text = compare_report.prediction_report(RUNS, 467_584, 2)
    assert text.startswith("PLANNER PREDICTIONS") and "NOT measurements" in text and "loopback" in text
    small = " ".join(_block(text, "This model (467,584 params"))
    assert "on 2 machines of one CPU rank each, like the ranks above" in small
    assert f"the planner's built-in CPU table ({default_local_costs.MEASURED_ON})" in small
    assert "gloo's link efficiency" in small
    assert sum(line.startswith("lion_fp32 ") for line in text.splitlines()) == 2 * len(compare_report.LINK_RATES)
    # Ranks that ran on CUDA are not what the small block prices: it says so.
    on_gpus = " ".join(_block(compare_report.prediction_report(RUNS, 467_584, 2, "cuda"), "This model"))
    assert "one CPU rank each, not the CUDA ranks above" in on_gpus


def test_planner_command_is_what_the_command_line_takes(capsys: pytest.CaptureFixture[str]) -> None:
    command = compare_report.large_model_cluster().planner_command("10gbit", zero_stage=0)
    argv = command.removeprefix("python -m ds_lioncub.planner ").split()
    by_report = json.loads(_planner_cli(capsys, *argv, "--json"))
    by_hand = json.loads(
        _planner_cli(capsys, *LARGE_CLI, "--inter-node-bandwidth", "10gbit", "--zero-stage", "0", "--json")
    )
    assert by_report == by_hand


@pytest.mark.parametrize(
    ("half_width", "kappa", "expected"),
    [
        # +3.3 [+0.3, +6.3], worth 0.75 of the batch: first to Lion's loss, with its gap's interval
        (3.0, 0.75, "Recommended at stage 0, though the study cannot tell whether within 2%: lioncub_1bit, loss vs"),
        # worth a twentieth of the batch (r = 20): slower to Lion's loss than the modes after it, passed over
        (1.0, 0.05, "Passed over at stage 0, though faster per step: lioncub_1bit, later to exact Lion's loss ("),
    ],
)
def test_recommendations_name_the_stage0_mode_passed_over_or_not_cleared(
    monkeypatch: pytest.MonkeyPatch, half_width: float, kappa: float, expected: str
) -> None:
    # The 1.3B model's 4 x 8 cluster votes over 32 ranks at stage 0; the study's one cell, the 1-bit vote's there
    # with the clip the configs run (the mean gradient's, at their gradient_clipping).
    from ds_lioncub.planner import convergence
    from ds_lioncub.planner.time_to_loss import Kappa

    cell = convergence.StudyCell("1bit+clip", 32, 0.99, 3.3, half_width, 3, kappa=Kappa(kappa))
    monkeypatch.setattr(convergence, "load_evidence", lambda: (cell,))
    found = compare_report.recommendations(compare_report.large_model_cluster(), link_rates=("1gbit",))
    text = " ".join(line.strip() for line in compare_report.format_recommendations(found, RUNS))
    assert expected in text
    assert ("stage 0: 1-bit vote + clip (" in text) is (half_width == 3.0)
