"""LionCub inside the real DeepSpeed engine, started by the real `deepspeed` launcher on CPU ranks.

Two launches: one 2-rank job runs every config in configs/ (plus ZeRO 1/3 and a bf16 momentum-sync
variant), checkpoint resumes, client optimizers and bad configs; one 3-rank job resumes the 2-rank
checkpoint. References: the exact-Lion (ZeRO 0) run for ZeRO, the uninterrupted run for resumes,
DeepSpeed's own learning rate and WarmupLR's documented formula for schedules, the saved per-rank
files for a resume at another world size.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_lioncub import parse_config
from ds_lioncub.comm import wire
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from ds_lioncub.planner.auto import resolve_auto
from ds_lioncub.planner.model import DEEPSPEED_BUCKET_SIZE
from tests.support.checks import same_message_on_every_rank
from tests.support.launch import REPO, run_deepspeed
from tests.support.planned_cases import AUTO_NETWORK, LAUNCHED_NODE_SIZE, LAUNCHED_WORLD, recommended
from tests.support.reference import reference_bucket_sizes
from tests.workers.ds_engine_scenarios import OVERFLOW_STEP, STEPS, TELEMETRY_BUCKET_SIZE, TELEMETRY_JOB

pytestmark = pytest.mark.deepspeed

WORKER = REPO / "tests" / "workers" / "ds_engine_scenarios.py"
CONFIG_NAMES = sorted(path.stem for path in (REPO / "configs").glob("*.json"))
EXACT_LION = ("lion_fp32", "lion_bf16_comm", "lion_zero2", "lion_zero1", "lion_zero3")


def _compressed(name: str) -> bool:
    return name.startswith("lioncub_")


def _hybrid(name: str) -> bool:
    """Compressed under ZeRO-1/2: ZeRO keeps reducing gradients inside each node, LionCub votes across nodes."""
    return name.endswith("_hybrid")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("deepspeed")
    main_files = [out / f"main-rank{rank}.pt" for rank in range(2)]
    run_deepspeed(
        WORKER,
        2,
        ["--out", str(out), "--phase", "main", "--deepspeed_config", "configs/lioncub_1bit.json"],
        main_files,
    )
    checkpoint = out / "ckpt-lioncub_1bit"
    resume_files = [out / f"resume-rank{rank}.pt" for rank in range(3)]
    run_deepspeed(WORKER, 3, ["--out", str(out), "--phase", "resume", "--checkpoint", str(checkpoint)], resume_files)
    return {
        "main": [torch.load(path, weights_only=False) for path in main_files],
        "resume": [torch.load(path, weights_only=False) for path in resume_files],
        "checkpoint": checkpoint,
        "out": out,
    }


def _configs(launched: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    ranks = launched["main"]
    names = [key.removeprefix("config/") for key in ranks[0] if key.startswith("config/")]
    return {name: [results[f"config/{name}"] for results in ranks] for name in names}


def test_every_ready_config_is_exercised(launched: dict[str, Any]) -> None:
    assert set(CONFIG_NAMES) <= set(_configs(launched))


def test_every_config_lowers_the_loss_and_keeps_ranks_bitwise_identical(launched: dict[str, Any]) -> None:
    for name, ranks in _configs(launched).items():
        losses = ranks[0]["losses"]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, f"{name}: {losses}"
        for param, value in ranks[0]["params"].items():
            assert torch.equal(ranks[1]["params"][param], value), f"{name}: {param} differs between ranks"


def test_initialize_does_not_move_parameters(launched: dict[str, Any]) -> None:
    """The bf16 wrapper's state-creating dummy step on zero gradients must be a no-op (a tie would move)."""
    for name, ranks in _configs(launched).items():
        assert ranks[0]["moved_at_init"] == 0.0, name


def test_compression_replaces_the_engine_gradient_allreduce(launched: dict[str, Any]) -> None:
    for name, ranks in _configs(launched).items():
        if _hybrid(name):
            assert ranks[0]["enable_backward_allreduce"] is True, name  # ZeRO's reduction inside the node
            assert ranks[0]["comm_stats"].collectives > 0, name
        elif _compressed(name):
            assert ranks[0]["enable_backward_allreduce"] is False, name
            assert ranks[0]["engine_allreduces"] == 0, name
            assert ranks[0]["comm_stats"].collectives > 0, name
        elif name in ("lion_fp32", "lion_bf16_comm", "lion_zero1", "lion_zero2"):
            assert ranks[0]["enable_backward_allreduce"] is True, name
            assert ranks[0]["engine_allreduces"] > 0, name  # the counter does see the engine's reduction


def test_zero_stages_are_exact_sharded_lion(launched: dict[str, Any]) -> None:
    configs = _configs(launched)
    reference = configs["lion_fp32"][0]["params"]
    for name in ("lion_zero1", "lion_zero2", "lion_zero3"):
        for param, value in configs[name][0]["params"].items():
            assert torch.equal(value, reference[param]), f"{name}: {param}"


def test_bf16_gradient_communication_is_used_and_stays_close(launched: dict[str, Any]) -> None:
    configs = _configs(launched)
    fp32, bf16 = configs["lion_fp32"][0]["params"], configs["lion_bf16_comm"][0]["params"]
    differing = sum(int((bf16[name] != fp32[name]).sum()) for name in fp32)
    total = sum(value.numel() for value in fp32.values())
    assert 0 < differing < 0.05 * total


def test_lioncub_applies_the_engine_learning_rate_every_step(launched: dict[str, Any]) -> None:
    """With ±1 updates each coordinate moves by exactly the lr DeepSpeed reported for that step."""
    for name, ranks in _configs(launched).items():
        if not _compressed(name):
            continue
        record = ranks[0]
        for lr, largest, smallest in zip(record["lr"], record["moved_max"], record["moved_min"], strict=True):
            assert largest == pytest.approx(lr, rel=2e-3, abs=1e-8), name
            assert smallest == pytest.approx(lr, rel=2e-3, abs=1e-8), name
    configs = _configs(launched)
    warmup = configs["lioncub_1bit"][0]["lr"]  # WarmupLR, linear, 1e-4 -> 1e-3 over 10 steps
    expected = [1e-4] + [1e-4 + (1e-3 - 1e-4) * min(step - 2, 10) / 10 for step in range(2, len(warmup) + 1)]
    assert warmup == pytest.approx(expected, rel=1e-6)
    cosine = configs["lioncub_4bit_sign"][0]["lr"]  # WarmupCosineLR
    assert len(set(cosine)) > 5


def test_gradient_accumulation_steps_once_per_boundary(launched: dict[str, Any]) -> None:
    record = _configs(launched)["lioncub_8bit_l1"][0]
    assert record["lioncub_step"] == list(range(1, len(record["lioncub_step"]) + 1))


@pytest.mark.parametrize("base", ["lioncub_1bit", "lioncub_8bit_l1", "lioncub_1bit_head_sync_bf16"])
def test_overlap_with_backward_gives_the_same_bits_on_every_rank(launched: dict[str, Any], base: str) -> None:
    """Votes started from the engine's boundary backward; clipping (lioncub_1bit) makes step() vote again;
    under bf16 the hooks fire on the module's bf16 parameters and LionCub steps the wrapper's fp32 copies."""
    configs = _configs(launched)
    for rank, (plain, overlapped) in enumerate(zip(configs[base], configs[f"{base}_overlap"], strict=True)):
        for param, value in plain["params"].items():
            assert torch.equal(overlapped["params"][param], value), f"rank {rank}: {param}"
        for index, momentum in enumerate(plain["momenta"]):
            assert torch.equal(overlapped["momenta"][index], momentum), f"rank {rank}: momentum {index}"
    for overlapped in configs[f"{base}_overlap"]:  # one bucket (the model is small), launched by the hooks
        assert overlapped["buckets_launched_in_backward"] == len(overlapped["lr"]), "every step's vote began early"
    if base == "lioncub_1bit":  # clipping at 1.0 rescales the early gradients after backward
        assert configs[f"{base}_overlap"][0]["revoted_buckets"] > 0


@pytest.mark.parametrize("variant", ["lioncub_1bit_head_sync", "lioncub_1bit_head_sync_bf16"])
def test_head_momentum_sync_by_module_names(launched: dict[str, Any], variant: str) -> None:
    """Names come from the engine's module, also when the optimizer holds bf16's fp32 copies."""
    names = launched["main"][0]["names"]
    ranks = _configs(launched)[variant]
    for step, expected in ((9, set()), (10, {"lm_head.weight"})):
        equal = {
            name
            for name, a, b in zip(names, ranks[0][f"momenta@{step}"], ranks[1][f"momenta@{step}"], strict=True)
            if torch.equal(a, b)
        }
        assert equal == expected, f"{variant} step {step}"


@pytest.mark.parametrize("config", ["lioncub_1bit", "lioncub_4bit_sign", "lioncub_ef_residual", "lioncub_ef21"])
def test_checkpoint_resume_reproduces_the_uninterrupted_run(launched: dict[str, Any], config: str) -> None:
    """Error feedback included: its per-bucket state is in each rank's file, and the resumed run
    equals the uninterrupted one bit for bit only if that state came back exactly. The gradient noise scale
    too: the resumed run goes on averaging where the saved one stopped."""
    for rank, results in enumerate(launched["main"]):
        record = results[f"resume/{config}"]
        assert record["aggregation_saved"] == config.startswith("lioncub_ef"), f"rank {rank}"
        for name, value in record["uninterrupted"].items():
            assert torch.equal(record["resumed"][name], value), f"rank {rank}: {name}"
        for index, (a, b) in enumerate(zip(record["uninterrupted_momenta"], record["resumed_momenta"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: momentum {index}"
        noise = record["uninterrupted_noise_scale"]
        assert noise is not None and noise.steps > 0, f"rank {rank}: the noise scale was not measured"
        assert record["resumed_noise_scale"] == noise, f"rank {rank}"
    first, second = (results[f"resume/{config}"]["resumed_momenta"] for results in launched["main"])
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), "per-rank momenta should differ"


def test_resume_at_another_world_size_starts_from_the_mean_momentum(launched: dict[str, Any]) -> None:
    tag = (launched["checkpoint"] / "latest").read_text().strip()
    saved = [
        torch.load(launched["checkpoint"] / tag / f"lioncub_dp_rank_{rank:05d}.pt", weights_only=True)["exp_avg"]
        for rank in range(2)
    ]
    for results in launched["resume"]:
        for index, loaded in enumerate(results["loaded_momenta"]):
            torch.testing.assert_close(loaded, (saved[0][index] + saved[1][index]) / 2)
        assert results["lioncub_step"] == 8
        assert all(torch.isfinite(torch.tensor(results["losses"])))
    for name, value in launched["resume"][0]["params"].items():
        for results in launched["resume"][1:]:
            assert torch.equal(results["params"][name], value), name


@pytest.mark.parametrize(
    ("kind", "fragments"),
    [
        ("missing", ["incomplete", "saved by 2 ranks", "missing lioncub_dp_rank_00001.pt"]),
        ("truncated", ["lioncub_dp_rank_00000.pt is truncated or unreadable"]),
        ("foreign", ["lioncub_dp_rank_00001.pt comes from another run", "rank 1 of 3"]),
        ("other_model", ["lioncub_dp_rank_00001.pt was saved for another model", "parameter #0"]),
    ],
)
@pytest.mark.parametrize("config", ["lioncub_1bit", "lioncub_4bit_sign"])  # fp32 and bf16
def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(
    launched: dict[str, Any], config: str, kind: str, fragments: list[str]
) -> None:
    """Resumed at another world size (3 ranks from a 2-rank save), where every file is read: nothing is loaded."""
    message = same_message_on_every_rank(launched["resume"], f"damaged/{config}/{kind}")
    assert message is not None and message.startswith("LionCubSetupError: LionCub: cannot resume from"), message
    for fragment in fragments:
        assert fragment in message, message
    assert all(results[f"damaged/{config}/{kind}/unchanged"] for results in launched["resume"])


def test_side_files_record_their_run(launched: dict[str, Any]) -> None:
    tag = (launched["checkpoint"] / "latest").read_text().strip()
    for rank in range(2):
        state = torch.load(launched["checkpoint"] / tag / f"lioncub_dp_rank_{rank:05d}.pt", weights_only=True)
        assert (state["format"], state["world_size"], state["rank"]) == (2, 2, rank)
        assert state["step"] == 4 and len(state["parameters"]) == len(state["exp_avg"])
        assert "'compression': '1bit'" in state["options"]
    assert not list((launched["checkpoint"] / tag).glob("*.tmp"))  # written to a temporary name, then renamed


def test_every_lioncub_step_record_is_the_steps_traffic(launched: dict[str, Any]) -> None:
    """Under every config (ZeRO hybrid, bf16, accumulation, exact Lion) each engine step's record equals the
    comm_stats() difference across that step, on every rank."""
    checked = 0
    for name, ranks in _configs(launched).items():
        for rank, record in enumerate(ranks):
            if "telemetry" not in record:
                continue
            assert len(record["telemetry"]) == STEPS, name
            for step, (telemetry, traffic) in enumerate(zip(record["telemetry"], record["comm_per_step"], strict=True)):
                where = f"{name} rank {rank} step {step + 1}"
                assert not telemetry.skipped, where
                assert (telemetry.collectives, telemetry.bytes_sent, telemetry.bytes_received) == (
                    traffic.collectives,
                    traffic.bytes_sent,
                    traffic.bytes_received,
                ), where
                assert (telemetry.bytes_sent > 0) == _compressed(name), where
            checked += 1
    assert checked >= 2 * len(CONFIG_NAMES)


def _csv_rows(directory: Path, event: str) -> list[tuple[int, str]]:
    """DeepSpeed's CSV monitor file of ``event`` (``LionCub/x`` is written to ``LionCub_x.csv``), header checked."""
    with (directory / f"{event.replace('/', '_')}.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", event.rsplit("/", 1)[-1]], rows[0]
    return [(int(step), value) for step, value in rows[1:]]


def test_telemetry_is_written_through_deepspeeds_csv_monitor(launched: dict[str, Any]) -> None:
    """The CSV monitor's LionCub/ rows: rank 0's records, at the engine's sample count, with bytes equal to
    comm_stats() and to the wire formulas for the 1-bit vote's buckets plus the default clip's sketch, which carries
    the non-finite check's verdict (one collective, no 4-byte all-reduce of its own)."""
    ranks = _configs(launched)["lioncub_1bit_telemetry"]
    directory = launched["out"] / "csv" / TELEMETRY_JOB
    records = ranks[0]["telemetry"]
    samples_per_step = 16 * 2  # configs/lioncub_1bit.json: 16 per micro-batch, 2 ranks, no accumulation
    steps = [samples_per_step * step for step in range(1, STEPS + 1)]
    buckets = reference_bucket_sizes(ranks[0]["parameter_numels"], TELEMETRY_BUCKET_SIZE)
    assert len(buckets) > 1
    # The default clip's sketch (with the noise scale's squared norm and the non-finite verdict) and the votes.
    sketch = wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), 2)
    expected_bytes = sketch + sum(wire.vote_1bit_bytes(n, 2) for n in buckets)
    for event in ("bytes_sent", "bytes_received"):
        rows = _csv_rows(directory, f"LionCub/{event}")
        assert [step for step, _ in rows] == steps, event
        assert [int(value) for _, value in rows] == [expected_bytes] * STEPS, event
        assert [int(value) for _, value in rows] == [getattr(t, event) for t in ranks[0]["comm_per_step"]], event
    collectives = _csv_rows(directory, "LionCub/collectives")
    assert [int(value) for _, value in collectives] == [1 + 2 * len(buckets)] * STEPS
    for event in ("skipped", "revoted_buckets"):
        assert [int(value) for _, value in _csv_rows(directory, f"LionCub/{event}")] == [0] * STEPS, event
    for event in ("tie_rate", "agreement_rate", "comm_seconds", "local_seconds"):
        rows = _csv_rows(directory, f"LionCub/{event}")
        assert [float(value) for _, value in rows] == [getattr(record, event) for record in records], event
    assert all(0 < record.tie_rate < 1 and 0 < record.agreement_rate < 1 for record in records)
    # The gradient noise scale, in samples and in voter batches: a voter's batch is 16 samples here (one rank a
    # voter, micro-batch 16, no accumulation), which the wiring takes from the engine.
    measured = [(step, r) for step, r in zip(steps, records, strict=True) if r.noise_scale is not None]
    assert measured, "the noise scale was never measured"
    noise_rows = [(step, float(value)) for step, value in _csv_rows(directory, "LionCub/noise_scale")]
    assert noise_rows == [(step, r.noise_scale) for step, r in measured]
    for _, record in measured:
        assert record.noise_scale_voter_batches is not None
        assert record.noise_scale == pytest.approx(16 * record.noise_scale_voter_batches, rel=1e-12)
    # Telemetry and the bucket size change nothing: the same run as lioncub_1bit, bit for bit.
    plain = _configs(launched)["lioncub_1bit"][0]["params"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, plain[name]), name


@pytest.mark.parametrize("kind", ["object", "callable"])
def test_client_lioncub_gets_the_same_wiring(launched: dict[str, Any], kind: str) -> None:
    records = [results[f"client/{kind}"] for results in launched["main"]]
    assert records[0]["enable_backward_allreduce"] is False
    assert records[0]["engine_allreduces"] == 0 and records[0]["comm_collectives"] > 0
    assert records[0]["losses"][-1] < records[0]["losses"][0]
    for name, value in records[0]["params"].items():
        assert torch.equal(records[1]["params"][name], value)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("bits", ["LionCubConfigError", "bits=3", "2, 4 or 8"]),
        ("unknown-key", ["LionCubConfigError", "unknown option 'momentun'", "Valid options"]),
        ("world-too-large", ["at most 1 workers", "world has 2", "kbit_algorithm='alltoall'"]),
        ("zero3-hpz", ["LionCubConfigError", "ZeRO stage 3", "hpZ", "zero_hpz_partition_size to 1"]),
        ("overlap-zero2", ["LionCubConfigError", "ZeRO stage 2", "overlap", "drop overlap"]),
    ],
)
def test_bad_ds_config_is_rejected_identically_on_every_rank(
    launched: dict[str, Any], case: str, expected: list[str]
) -> None:
    message = same_message_on_every_rank(launched["main"], f"bad/{case}")
    for fragment in expected:
        assert fragment in message


def assert_ranks_hold_the_same_parameters(records: list[dict[str, Any]]) -> None:
    for name, value in records[0]["params"].items():
        for record in records[1:]:
            assert torch.equal(record["params"][name], value), name


@pytest.fixture(scope="module")
def cuda_precisions(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The fp16 phase's records (fp16, fp16 with an overflow, bf16), one per rank, on up to 2 CUDA devices."""
    if not torch.cuda.is_available():
        pytest.skip("the fp16 and bf16 engine checks need a CUDA device (CI and this CPU machine have none)")
    out = tmp_path_factory.mktemp("cuda-precisions")
    ranks = min(torch.cuda.device_count(), 2)
    files = [out / f"fp16-rank{rank}.pt" for rank in range(ranks)]
    run_deepspeed(WORKER, ranks, ["--out", str(out), "--phase", "fp16"], files, environment={"DS_ACCELERATOR": "cuda"})
    return [torch.load(path, weights_only=False) for path in files]


@pytest.mark.gpu
def test_fp16_on_cuda(cuda_precisions: list[dict[str, Any]]) -> None:
    records = [ranks["fp16"] for ranks in cuda_precisions]
    assert records[0]["moved_at_init"] == 0.0
    for record in records:  # a step skipped on overflow never reaches LionCub and is recorded as skipped
        assert record["telemetry_totals"].skipped_steps == record["skipped_steps"]
        assert record["telemetry_totals"].steps == len(record["losses"])
    losses = records[0]["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05
    assert_ranks_hold_the_same_parameters(records)


@pytest.mark.gpu
def test_fp16_overflow_is_skipped_by_every_rank_and_changes_nothing(cuda_precisions: list[dict[str, Any]]) -> None:
    records = [ranks["fp16-overflow"] for ranks in cuda_precisions]
    for record in records:
        before, after = record["before"], record["after"]
        assert after["skipped"] == before["skipped"] + 1
        assert after["lioncub_step"] == before["lioncub_step"]
        for name, value in before["params"].items():
            assert torch.equal(after["params"][name], value), name
        for old, new in zip(before["momenta"], after["momenta"], strict=True):
            assert torch.equal(old, new)
        step = OVERFLOW_STEP - 1  # the scale halves at the overflow (hysteresis 1) and nowhere else before it
        assert record["scale"][step] == record["scale"][step - 1] / 2
        assert record["telemetry_totals"].skipped_steps == record["skipped_steps"] >= 1
        assert all(math.isfinite(loss) for loss in record["losses"])  # the loss itself; its backward got x inf
        losses = record["losses"]
        assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 - 0.05  # it trains on after the skipped step
    assert_ranks_hold_the_same_parameters(records)


@pytest.mark.gpu
def test_bf16_on_cuda_trains_with_ranks_identical(cuda_precisions: list[dict[str, Any]]) -> None:
    records = [ranks["bf16"] for ranks in cuda_precisions]
    assert records[0]["dtype"] == "torch.bfloat16"
    losses = records[0]["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05
    if len(records) > 1:  # a world of one has nobody to send to (the transport's shortcut)
        assert records[0]["comm_stats"].bytes_sent > 0  # the 4-bit sign vote really ran its collectives
    for record in records:
        assert all(torch.isfinite(value).all() for value in record["params"].values())
    assert_ranks_hold_the_same_parameters(records)


def _trained_elements(record: dict[str, Any]) -> int:
    return sum(value.numel() for value in record["params"].values())


def test_the_planners_recommended_block_trains_and_sends_the_predicted_bytes(launched: dict[str, Any]) -> None:
    """Loss and bitwise identity: the test over every config above; here: the block is the recommendation,
    and every rank's LionCub sent what the planner predicted per step (collectives as the optimizer issues them)."""
    ranks = _configs(launched)["lioncub_planner"]
    best = recommended(_trained_elements(ranks[0]))
    assert best.compression != "none"  # at 1 Gbit/s: the run exercises a compressed mode's collectives
    for record in ranks:
        # As LionCub reads the block (its clip with every field filled in).
        assert {key: record["options"][key] for key in best.params} == parse_config(best.params).model_dump(
            include=set(best.params)
        )
        steps = len(record["losses"])
        assert record["comm_stats"].bytes_sent == steps * best.bytes_per_step_per_rank


def test_auto_resolves_to_the_planners_choice_alike_on_every_rank(launched: dict[str, Any]) -> None:
    ranks = _configs(launched)["lioncub_auto"]
    assert all(record["options"] == ranks[0]["options"] for record in ranks)
    config = json.loads((REPO / "configs" / "lioncub_1bit.json").read_text())["optimizer"]["params"]
    hyper = {key: config[key] for key in ("lr", "betas", "weight_decay")}
    options = parse_config({**hyper, "compression": "auto", "network": AUTO_NETWORK})
    expected = resolve_auto(
        options,
        _trained_elements(ranks[0]),
        LAUNCHED_WORLD,
        LAUNCHED_NODE_SIZE,
        0,
        exact_comm_dtypes=("fp32",),  # the engine's gradient all-reduce in an fp32 job
        exact_bucket_size=DEEPSPEED_BUCKET_SIZE,
        default_clip=1.0,  # the config's gradient_clipping, which a compressed mode clips the mean gradient at
    )
    assert expected.options.compression != "none" and not expected.fell_back
    assert ranks[0]["options"] == expected.options.model_dump()
