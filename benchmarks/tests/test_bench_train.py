"""bench_train.py's own logic: method configs, the baseline Lion, the report arithmetic, two real runs.

The arithmetic is checked against plain loops written here; the end-to-end run trains three methods
on two local gloo ranks (``--loopback``) and checks that the step breakdown adds up, that collectives
were timed, and that DDP + PlainLion lands where DeepSpeed + LionCub's exact Lion does (two independent
implementations of the same training). A second run in the emulated cluster (root) checks the bytes on
the wire.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import REPO, train_report
from benchmarks.plain_lion import PlainLion
from benchmarks.train_methods import METHODS, METHODS_BY_NAME, TrainSettings, ds_config, select_methods
from ds_lioncub.comm import wire
from ds_lioncub.config import parse_config
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from tests.support.reference import reference_lion_step

# The small GPT of the emulated-cluster runs (the loopback run uses a smaller one).
CLUSTER_MODEL = [
    *("--d-model", "128", "--n-layer", "2", "--n-head", "4"),
    *("--micro-batch", "2", "--seq-len", "16", "--eval-windows", "8"),
]

# ---------------------------------------------------------------------------------------------- methods


@pytest.mark.parametrize("method", [m for m in METHODS if m.runtime == "deepspeed"], ids=lambda m: m.name)
def test_deepspeed_methods_have_valid_lioncub_options(method) -> None:
    settings = TrainSettings(lr=5e-4, weight_decay=0.2)
    config = ds_config(method, settings)
    options = parse_config(config["optimizer"]["params"])  # raises on anything LionCub would refuse
    assert options.lr == 5e-4 and options.weight_decay == 0.2
    assert options.betas == (settings.beta1, method.beta2)
    assert options.compression == method.lioncub["compression"]
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default would clip at 1.0
    assert config.get("communication_data_type") == method.communication_data_type


def test_zero_methods_configs() -> None:
    settings = TrainSettings()
    zero2 = ds_config(METHODS_BY_NAME["lion_zero2"], settings, node_size=2)
    assert zero2["zero_optimization"] == {"stage": 2}
    assert zero2["optimizer"]["params"]["compression"] == "none" and "hybrid" not in zero2["optimizer"]["params"]
    hybrid = ds_config(METHODS_BY_NAME["lioncub_1bit_zero2_hybrid"], settings, node_size=2)
    assert hybrid["zero_optimization"] == {"stage": 2}
    assert hybrid["optimizer"]["params"]["compression"] == "1bit"
    assert hybrid["optimizer"]["params"]["hybrid"] == {"node_size": 2}
    assert parse_config(hybrid["optimizer"]["params"]).compression == "1bit"
    # Stage 0 is untouched by the cluster's node size.
    stage0 = ds_config(METHODS_BY_NAME["lioncub_1bit"], settings, node_size=2)
    assert "zero_optimization" not in stage0 and "hybrid" not in stage0["optimizer"]["params"]
    assert stage0 == ds_config(METHODS_BY_NAME["lioncub_1bit"], settings)
    with pytest.raises(ValueError, match="node_size must be >= 1"):
        ds_config(METHODS_BY_NAME["lion_zero2"], settings, node_size=0)


def test_bench_train_node_size_must_divide_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_train import parse_args, worker_command

    args = parse_args(["--out-dir", "unused-out-dir", "--ranks", "4", "--node-size", "2"])
    assert args.node_size == 2
    command = worker_command(args, METHODS_BY_NAME["lioncub_1bit_zero2_hybrid"])
    assert command[command.index("--node-size") + 1] == "2"
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", "unused-out-dir", "--ranks", "4", "--node-size", "3"])
    assert "positive multiple of --node-size" in capsys.readouterr().err


def test_every_reference_is_a_method_with_the_same_beta2() -> None:
    for method in METHODS:
        reference = METHODS_BY_NAME[method.reference]
        assert reference.beta2 == method.beta2, method.name
        assert not reference.compressed and reference.communication_data_type is None, method.name


def test_select_methods() -> None:
    assert [m.name for m in select_methods("lioncub_1bit, ddp_bf16")] == ["lioncub_1bit", "ddp_bf16"]
    assert len(select_methods("all")) == len(METHODS)
    with pytest.raises(ValueError, match="unknown method.*'lion_fp64'.*choose from: lion_fp32"):
        select_methods("lion_fp32,lion_fp64")
    with pytest.raises(ValueError):
        ds_config(METHODS_BY_NAME["ddp_bf16"], TrainSettings())
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        TrainSettings(micro_batch=0)


def test_plain_lion_matches_the_reference_lion() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (11,), (3, 2, 4)]
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    reference_params = [p.clone() for p in params]
    reference_momenta = [torch.zeros_like(p) for p in params]
    trained = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = PlainLion(trained, lr=0.01, betas=(0.9, 0.95), weight_decay=0.3)
    for _ in range(4):
        grads = [torch.randn(shape, generator=gen) for shape in shapes]
        for param, grad in zip(trained, grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
        reference_lion_step(reference_params, grads, reference_momenta, 0.01, (0.9, 0.95), 0.3)
    for param, expected in zip(trained, reference_params, strict=True):
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="lr > 0"):
        PlainLion(trained, lr=0.0)


# ---------------------------------------------------------------------------------------------- report


def _result(
    name: str, totals: list[float], losses: list[float], val_loss: float, n_params: int = 1000, tx: float = 500.0
) -> dict:
    """A worker result whose step parts are fixed fractions of each total (forward .1, backward .2, update .3)."""
    method = METHODS_BY_NAME[name]
    return {
        "method": {"name": name, "beta2": method.beta2, "reference": method.reference},
        "settings": {"lr": 1e-3, "weight_decay": 0.1, "n_layer": 1, "d_model": 8, "micro_batch": 2, "seq_len": 4},
        "world_size": 2,
        "steps": len(totals),
        "n_params": n_params,
        "threads_per_rank": 1,
        "link_rate_bps": None,
        "val_loss": val_loss,
        "params_in_sync": True,
        "per_step": {
            "forward_s": [0.1 * t for t in totals],
            "backward_s": [0.2 * t for t in totals],
            "update_s": [0.3 * t for t in totals],
            "comm_s": [0.4 * t for t in totals],
            "total_s": totals,
            "loss": losses,
            "tx_bytes": [tx] * len(totals),
            "rx_bytes": [tx] * len(totals),
        },
    }


def test_breakdown_skips_the_warmup_steps_and_means_the_rest() -> None:
    totals = [9.0, 8.0, 7.0, 1.0, 2.0, 3.0]
    row = train_report.breakdown(_result("lion_fp32", totals, [1.0] * 6, 2.0), warmup=3)
    assert row.total_s == pytest.approx(2.0) and row.comm_s == pytest.approx(0.8)
    assert row.forward_s + row.backward_s + row.update_s + row.comm_s == pytest.approx(row.total_s)
    assert row.comm_share == pytest.approx(0.4)
    # Fewer steps than the warm-up: the last step still counts.
    assert train_report.breakdown(_result("lion_fp32", [5.0, 4.0], [1.0] * 2, 2.0), warmup=3).total_s == 4.0


def test_loss_helpers_against_plain_loops() -> None:
    values = [5.0, 3.0, 4.0, 1.0, 0.5, 2.5]
    for window in (1, 2, 4, 10):
        expected = [
            sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))
        ]
        assert train_report.moving_average(values, window) == pytest.approx(expected)
    result = _result("lion_fp32", [0.5, 0.25, 1.0], [3.0, 2.0, 1.0], 2.0)
    assert train_report.wall_clock(result) == pytest.approx([0.5, 0.75, 1.75])
    assert train_report.final_train_loss(result, tail=2) == pytest.approx(1.5)
    assert train_report.relative_gap(2.04, 2.0) == pytest.approx(0.02)


def test_targets_and_tables() -> None:
    results = {
        "lion_fp32": _result("lion_fp32", [4.0] * 5, [3.0] * 5, 2.00, tx=80_000.0),
        "lioncub_1bit": _result("lioncub_1bit", [0.8] * 5, [3.1] * 5, 2.10, tx=2_500.0),
        "lioncub_4bit_sign": _result("lioncub_4bit_sign", [1.25] * 5, [3.0] * 5, 2.03),
        "lioncub_8bit_l1": _result("lioncub_8bit_l1", [1.0] * 5, [3.0] * 5, 2.05),
    }
    lines = train_report.target_lines(results)
    text = "\n".join(lines)
    assert "communication is 40% of it" in text and "NOT met" in lines[0]  # 40% < 80%
    assert "Lion Cub 1-bit vote step 5.00x faster" in text and "target >= 4x: met" in lines[1]
    assert "Lion Cub 4-bit sign step 3.20x faster" in lines[2] and "NOT met" in lines[2]
    assert "+1.50% (target within 2%: met)" in text  # 2.03 vs 2.00
    assert "+2.50% (target within 2%: NOT met)" in text  # 2.05 vs 2.00
    table = train_report.breakdown_table(results)
    one_bit = next(line for line in table.splitlines() if line.startswith("| Lion Cub 1-bit vote"))
    # 2,500 bytes of 1,000 parameters: 20 bits each; 0.8 s total, 40% of it communication
    assert "| 800 |" in one_bit and "| 40% |" in one_bit and "| 5.00x |" in one_bit and "| 20.00 |" in one_bit
    quality = train_report.quality_table(results)
    assert "| +5.00% |" in next(line for line in quality.splitlines() if "1-bit" in line)


def test_zero_table_and_hybrid_targets() -> None:
    def zero_result(name: str, total: float, tx: float, state: int, val_loss: float) -> dict:
        result = _result(name, [total] * 5, [3.0] * 5, val_loss, tx=tx)
        result["method"]["zero_stage"] = METHODS_BY_NAME[name].zero_stage
        result.update(node_size=2, world_size=4, optimizer_state_bytes=[state] * 4)
        return result

    results = {
        "lioncub_1bit": zero_result("lioncub_1bit", 0.5, 1_400_000.0, 4000, 2.00),
        "lion_zero2": zero_result("lion_zero2", 1.8, 58_000_000.0, 1000, 1.90),
        "lioncub_1bit_zero2_hybrid": zero_result("lioncub_1bit_zero2_hybrid", 1.0, 800_000.0, 2000, 2.03),
    }
    table = train_report.zero_table(results)
    hybrid_row = next(line for line in table.splitlines() if "ZeRO-2 hybrid" in line)
    assert hybrid_row == "| Lion Cub 1-bit, ZeRO-2 hybrid | 2 | 2 | 1000 | 400 | 0.800 | 0.00 | 2.0300 |"
    text = "\n".join(train_report.hybrid_target_lines(results))
    assert "step 1.80x faster than Lion, ZeRO-2 (1000 ms vs 1800 ms; target >= 2x: NOT met)" in text
    assert "72.5x fewer bytes between nodes" in text and "target >= 16x: met" in text
    assert "= 1/2.000 of Lion Cub 1-bit vote's" in text and "target 1/G = 1/2: met" in text
    assert "+1.50% (target within 2%: met)" in text
    # Results without the optimizer-state figure (older runs) are left out of the table, and no hybrid: no lines.
    del results["lion_zero2"]["optimizer_state_bytes"]
    assert "Lion, ZeRO-2" not in train_report.zero_table(results)
    assert train_report.hybrid_target_lines({"lion_zero2": results["lion_zero2"]}) == []
    assert "Between nodes and optimizer state" in train_report.markdown_report(results)


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[bench]')")
    import matplotlib.image

    results = {
        "lion_fp32": _result("lion_fp32", [1.0] * 4, [3.0, 2.5, 2.0, 1.9], 2.0),
        "lioncub_1bit_b95": _result("lioncub_1bit_b95", [0.5] * 4, [3.0, 2.6, 2.2, 2.0], 2.1),
    }
    paths = train_report.write_plots(results, tmp_path)
    assert [path.name for path in paths] == ["loss_vs_step.png", "loss_vs_time.png"]
    for path in paths:
        assert matplotlib.image.imread(path).shape[:2] == (550, 880)  # 8 x 5 inches at 110 dpi


def test_load_results_names_the_missing_method(tmp_path: Path) -> None:
    (tmp_path / "lion_fp32.json").write_text(json.dumps(_result("lion_fp32", [1.0], [1.0], 1.0)))
    assert list(train_report.load_results(tmp_path)) == ["lion_fp32"]
    with pytest.raises(FileNotFoundError, match="no result for lioncub_1bit"):
        train_report.load_results(tmp_path, ["lion_fp32", "lioncub_1bit"])


# ---------------------------------------------------------------------------------------------- a real run


@pytest.mark.distributed
def test_loopback_run_of_three_methods(tmp_path: Path, packing_op_build: tuple[Any, Any]) -> None:
    """Two gloo ranks, a tiny GPT, 4 steps each of exact Lion (DeepSpeed), DDP + PlainLion, Lion Cub 1-bit."""
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (pip install -e '.[bench]')")
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        "--loopback",
        "--ranks",
        "2",
        "--steps",
        "4",
        "--methods",
        "lion_fp32,ddp_bf16,lioncub_1bit",
        "--d-model",
        "32",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--micro-batch",
        "2",
        "--seq-len",
        "16",
        "--eval-windows",
        "8",
        "--lr",
        "1e-3",
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = train_report.load_results(out, ["lion_fp32", "ddp_bf16", "lioncub_1bit"])
    for name, result in results.items():
        steps = result["per_step"]
        assert len(steps["total_s"]) == 4 and result["params_in_sync"], name
        for i in range(4):
            parts = sum(steps[column][i] for column in ("forward_s", "backward_s", "update_s", "comm_s"))
            assert parts == pytest.approx(steps["total_s"][i], rel=1e-9, abs=1e-9), (name, i)
            assert min(steps[column][i] for column in ("forward_s", "backward_s", "update_s")) > 0, (name, i)
    # Collectives were timed where there are calls to time (the engine's all-reduce; LionCub's votes).
    assert sum(results["lion_fp32"]["per_step"]["comm_s"]) > 0
    assert sum(results["lioncub_1bit"]["per_step"]["comm_s"]) > 0
    assert results["ddp_bf16"]["ddp_backward_compute_s"] > 0
    # DDP + PlainLion (bf16 gradient average) and DeepSpeed + exact LionCub (fp32) train the same model
    # on the same batches: losses agree up to the rare sign flipped by bf16 rounding.
    fp32_losses = results["lion_fp32"]["per_step"]["loss"]
    assert results["ddp_bf16"]["per_step"]["loss"] == pytest.approx(fp32_losses, abs=2e-3)
    assert results["ddp_bf16"]["val_loss"] == pytest.approx(results["lion_fp32"]["val_loss"], abs=2e-3)
    # Step 1 is the same everywhere (same weights, same batch); the vote changes what follows.
    assert results["lioncub_1bit"]["per_step"]["loss"][0] == pytest.approx(fp32_losses[0], abs=1e-6)
    report = (out / "report.md").read_text()
    for label in ("Lion, fp32 all-reduce", "DDP + Lion, bf16_compress_hook", "Lion Cub 1-bit vote"):
        assert f"| {label} |" in report
    assert (out / "loss_vs_step.png").stat().st_size > 0


@pytest.mark.netns
def test_emulated_cluster_run_puts_the_expected_bytes_on_the_wire(
    tmp_path: Path, packing_op_build: tuple[Any, Any]
) -> None:
    """Two ranks behind 1 Gbit/s links: the per-step wire counters see fp32 all-reduce vs 1-bit vote bytes."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        "--ranks",
        "2",
        "--bandwidth",
        "1gbit",
        "--steps",
        "3",
        "--methods",
        "lion_fp32,lioncub_1bit",
        *CLUSTER_MODEL,
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = train_report.load_results(out, ["lion_fp32", "lioncub_1bit"])
    n = results["lion_fp32"]["n_params"]
    assert results["lion_fp32"]["link_rate_bps"] == 10**9
    # p = 2: an all-reduce sends (p-1)/p * 2 = 1 tensor per rank, fp32 gradients 4n bytes; the 1-bit
    # vote n/8 (all-to-all of half the signs, all-gather of half the vote), padded to 8p elements.
    # On the wire come headers (the counters see one set per 64 KiB offload super-frame: ~0.1%), the
    # ACKs for what the rank receives, and a few small messages (the finiteness check, gloo's own):
    # measured 1.003x and 1.03x of the model; nothing else may be sent. The 1-bit vote also sums the default clip's
    # sketch (and the noise scale's squared norm and the finiteness verdict): an fp64 all-reduce of 4,095 numbers.
    sketch = wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), 2)
    for name, model in (("lion_fp32", 4 * n), ("lioncub_1bit", math.ceil(n / 16) * 2 + sketch)):
        for step, sent in enumerate(results[name]["per_step"]["tx_bytes"]):
            assert model <= sent <= 1.10 * model, (name, step, sent, model)
    assert all(result["params_in_sync"] for result in results.values())


@pytest.mark.netns
def test_emulated_two_by_two_cluster_zero_hybrid_bytes_and_state(
    tmp_path: Path, packing_op_build: tuple[Any, Any]
) -> None:
    """2 nodes x 2 ranks: only the hybrid's 1-bit vote of a shard crosses between nodes; its state is 1/2 of stage 0."""
    out = tmp_path / "run"
    methods = ["lioncub_1bit", "lion_zero2", "lioncub_1bit_zero2_hybrid"]
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        "--ranks",
        "4",
        "--node-size",
        "2",
        "--bandwidth",
        "1gbit",
        "--steps",
        "3",
        "--methods",
        ",".join(methods),
        *CLUSTER_MODEL,
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = train_report.load_results(out, methods)
    for result in results.values():
        assert result["node_size"] == 2 and result["ranks_per_link"] == 2 and result["params_in_sync"]
        assert len(set(result["optimizer_state_bytes"])) == 1  # every rank holds the same amount
    stage0, zero2, hybrid = (train_report.state_bytes(results[name]) for name in methods)
    n = results["lioncub_1bit"]["n_params"]
    assert stage0 == 4 * n
    # ZeRO pads the flat buffer to an alignment before splitting it: a shard is at least n / G elements.
    assert 4 * n <= 2 * hybrid <= 4 * n * 1.01 and 4 * n <= 4 * zero2 <= 4 * n * 1.01
    # Between nodes each rank sends its share of the 1-bit vote of its shard over M = 2 nodes (the link's
    # bytes / 2 ranks): the library's own count, plus headers, ACKs and the small agreement messages.
    shard = hybrid // 4
    # And the default clip's sketch, summed across the nodes after inside them (4,094 fp64 numbers).
    model = wire.vote_1bit_bytes(shard, 2) + wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 1), 2)
    for step, sent in enumerate(results["lioncub_1bit_zero2_hybrid"]["per_step"]["tx_bytes"]):
        assert model <= sent <= 1.15 * model, (step, sent, model)
    zero2_sent = train_report.breakdown(results["lion_zero2"], warmup=0).tx_bytes
    assert zero2_sent >= 16 * train_report.breakdown(results["lioncub_1bit_zero2_hybrid"], warmup=0).tx_bytes


@pytest.mark.netns
def test_emulated_two_by_two_cluster_zero3_hybrid_bytes_between_nodes(
    tmp_path: Path, packing_op_build: tuple[Any, Any]
) -> None:
    """2 nodes x 2 ranks under ZeRO-3: the hybrid's parameter gathers and gradient reduce-scatters stay inside the
    node, so between nodes only the 1-bit vote of each rank's slices crosses (and small agreement messages);
    exact Lion under ZeRO-3 gathers and reduces over the whole world. Its state is each rank's slices."""
    out = tmp_path / "run"
    methods = ["lion_zero3", "lioncub_1bit_zero3_hybrid"]
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        *("--ranks", "4", "--node-size", "2", "--bandwidth", "1gbit", "--steps", "3"),
        *("--methods", ",".join(methods), *CLUSTER_MODEL, "--out-dir", str(out)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = train_report.load_results(out, methods)
    for result in results.values():
        assert result["node_size"] == 2 and result["ranks_per_link"] == 2 and result["params_in_sync"]
        assert len(set(result["optimizer_state_bytes"])) == 1
    n = results["lion_zero3"]["n_params"]
    zero3, hybrid = (train_report.state_bytes(results[name]) for name in methods)
    # ZeRO-3 slices every parameter into ceil(numel / P) elements: at least n / P each.
    assert 4 * n <= 4 * zero3 <= 4 * n * 1.01 and 4 * n <= 2 * hybrid <= 4 * n * 1.01
    # Each step: the 1-bit vote of the rank's slices (one sub-group) over M = 2 nodes, with headers, ACKs and
    # the agreement messages; the first step also carries ZeRO-3's one-off check of the module order.
    model = wire.vote_1bit_bytes(hybrid // 4, 2) + wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 1), 2)
    for step, sent in enumerate(results["lioncub_1bit_zero3_hybrid"]["per_step"]["tx_bytes"][1:], 2):
        assert model <= sent <= 1.15 * model, (step, sent, model)
    zero3_sent = train_report.breakdown(results["lion_zero3"], warmup=1).tx_bytes
    assert zero3_sent >= 16 * train_report.breakdown(results["lioncub_1bit_zero3_hybrid"], warmup=1).tx_bytes
