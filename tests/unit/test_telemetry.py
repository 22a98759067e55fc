"""Per-step telemetry in one process: the option, the vote rates at a world of one, the DeepSpeed hook's
skipped steps and monitor events, and the documented event names.

The byte counts and the multi-rank vote rates are checked on real gloo ranks
(tests/distributed/test_optimizer_distributed.py) and through the deepspeed launcher's CSV monitor
(tests/integration/test_deepspeed_engine.py).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_lioncub import LionCub, LionCubConfigError
from ds_lioncub.integration import engine_hooks
from ds_lioncub.telemetry import StepRecord
from tests.support import scenarios as sc
from tests.support.launch import REPO
from tests.support.reference import brute_force_vote_stats_for_options, reference_bucket_sizes
from tests.support.scenario_optimizer import fresh_params, scenario_lioncub

STEPS = 3


def train_alone(options: dict[str, Any]) -> tuple[LionCub, list[StepRecord]]:
    """The scenarios' model at a world of one for STEPS steps; every step's record."""
    params = fresh_params()
    optimizer = scenario_lioncub(params, **options)
    records = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        sc.loss_of(params, 0, step).backward()
        optimizer.step()
        assert optimizer.last_step_telemetry is not None
        records.append(optimizer.last_step_telemetry)
    return optimizer, records


def test_vote_stats_without_a_vote_is_refused_naming_the_fix() -> None:
    with pytest.raises(LionCubConfigError, match=r"telemetry.vote_stats only applies to compressed modes.*drop"):
        LionCub([torch.nn.Parameter(torch.ones(3))], compression="none", telemetry={"vote_stats": True})
    with pytest.raises(LionCubConfigError, match="unknown option 'telemetry.tie_rate'.*telemetry takes vote_stats"):
        LionCub([torch.nn.Parameter(torch.ones(3))], telemetry={"tie_rate": True})


@pytest.mark.parametrize(
    "mode", ["1bit", "4bit-sign-mean", "8bit-l1", "4bit-l1-alltoall", "2bit-l1-alltoall-mean", "1bit-positive"]
)
def test_vote_rates_alone_equal_the_brute_force_vote(mode: str) -> None:
    """At p = 1 the L1 modes tie wherever q = 0 and disagree where such a tie resolves against c's sign."""
    options = sc.training_modes(1)[mode]
    optimizer, records = train_alone(options)
    updates: list[list[torch.Tensor]] = []
    sc.simulate_mode(1, options, pre_sign_updates=updates)
    numels = [torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values()]
    for step, record in enumerate(records, start=1):
        assert (record.step, record.skipped, record.collectives, record.bytes_sent) == (step, False, 0, 0)
        assert record.buckets == len(reference_bucket_sizes(numels, sc.BUCKET_SIZE)) and record.local_seconds > 0
        if "telemetry" not in options:
            assert record.tie_rate is None and record.agreement_rate is None
            continue
        expected = brute_force_vote_stats_for_options(updates[step - 1], step, options, numels, sc.BUCKET_SIZE)
        assert (record.tie_rate, record.agreement_rate) == (expected.tie_rate, expected.agreement_rates[0])
    assert optimizer.telemetry_totals.steps == STEPS


class RecordingMonitor:
    """Stands in for DeepSpeed's MonitorMaster: keeps what write_events was given."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.written: list[list[tuple[str, float, int]]] = []

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        self.written.append(events)


def run_engine_steps(
    applied: list[bool], *, enabled: bool = True, global_rank: int = 0, calls_per_step: int = 1
) -> tuple[Any, LionCub]:
    """The _take_model_step wrapper around a stand-in for DeepSpeed's: it calls LionCub.step
    ``calls_per_step`` times (ZeRO: once per param group) unless the step overflowed (``applied``
    False), then advances the engine's sample count by 8, as the engine does."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 50))
    lioncub = LionCub([param], compression="1bit", telemetry={"vote_stats": True})

    def engine_take_model_step(engine: Any) -> None:
        if engine.applied.pop(0):
            for _ in range(calls_per_step):
                param.grad = torch.linspace(1, -1, 50)
                lioncub.step()
        engine.global_samples += 8

    engine = SimpleNamespace(
        basic_optimizer=lioncub,
        optimizer=SimpleNamespace(optimizer=lioncub),  # a DeepSpeed wrapper around it
        monitor=RecordingMonitor(enabled),
        global_rank=global_rank,
        global_samples=0,
        applied=list(applied),
    )
    wrapped = engine_hooks._wrap_take_model_step(engine_take_model_step)
    for _ in applied:
        wrapped(engine)
    return engine, lioncub


def test_a_step_deepspeed_skips_is_recorded_as_skipped_and_written_at_the_sample_count() -> None:
    engine, lioncub = run_engine_steps([True, False, True])
    written = engine.monitor.written
    assert [sorted({step for _, _, step in events}) for events in written] == [[8], [16], [24]]
    skipped = [dict((name, value) for name, value, _ in events)["LionCub/skipped"] for events in written]
    assert skipped == [0, 1, 0]
    names = [[name for name, _, _ in events] for events in written]
    assert "LionCub/tie_rate" in names[0] and "LionCub/tie_rate" not in names[1]  # no vote, no rate
    totals = lioncub.telemetry_totals
    assert (totals.steps, totals.skipped_steps) == (3, 1)
    assert lioncub.last_step_telemetry is not None and lioncub.last_step_telemetry.step == 2
    assert lioncub.param_groups[0]["step"] == 2


def test_an_engine_step_that_calls_step_per_param_group_gives_one_record_of_their_sum() -> None:
    single, _ = run_engine_steps([True])
    double, lioncub = run_engine_steps([True], calls_per_step=2)
    (one,), (two,) = single.monitor.written, double.monitor.written
    assert [name for name, _, _ in one] == [name for name, _, _ in two]
    record = lioncub.last_step_telemetry
    assert record is not None and (record.buckets, record.voted_elements) == (2, 100)
    assert lioncub.telemetry_totals.steps == 1 and record.step == 2


@pytest.mark.parametrize(("enabled", "global_rank"), [(False, 0), (True, 1)])
def test_nothing_is_written_where_deepspeeds_monitor_does_not_write(enabled: bool, global_rank: int) -> None:
    engine, lioncub = run_engine_steps([True, False], enabled=enabled, global_rank=global_rank)
    assert engine.monitor.written == []
    assert (lioncub.telemetry_totals.steps, lioncub.telemetry_totals.skipped_steps) == (2, 1)


def test_the_documented_event_names_are_the_written_ones() -> None:
    """docs/design.md section 15's table and the user guide's list name exactly what a record writes."""
    record = StepRecord(1, False, 2, 3, 3, 0.5, 0.25, 1, 0, 100, 50, 75)
    written = {name for name, _ in record.monitor_events()}
    for kind in ("residual", "ef21"):  # error feedback's ratio, one event per form
        with_feedback = StepRecord(1, False, 2, 3, 3, 0.5, 0.25, 1, 0, 100, 50, 75, kind, 0.1)
        written |= {name for name, _ in with_feedback.monitor_events()}
    with_noise = StepRecord(
        1, False, 2, 3, 3, 0.5, 0.25, 1, 0, 100, 50, 75, noise_scale=48.0, noise_scale_voter_batches=3.0
    )
    events = dict(with_noise.monitor_events())
    assert (events["LionCub/noise_scale"], events["LionCub/noise_scale_voter_batches"]) == (48.0, 3.0)
    written |= set(events)
    design = (REPO / "docs" / "design.md").read_text().split("## 15. Per-step telemetry")[1]
    assert set(re.findall(r"^\| `(LionCub/\w+)` \|", design, flags=re.MULTILINE)) == written
    guide = (REPO / "docs" / "user-guide.md").read_text().split("## With DeepSpeed")[1].split("\n## ")[0]
    assert {name for name in written if f"`{name}`" in guide} == written
    without_rates = StepRecord.skipped_step(1)
    assert {name for name, _ in without_rates.monitor_events()} == written - {
        "LionCub/tie_rate",
        "LionCub/agreement_rate",
        "LionCub/ef_residual_ratio",
        "LionCub/ef21_estimate_gap",
        "LionCub/noise_scale",
        "LionCub/noise_scale_voter_batches",
    }


def test_an_engine_step_records_the_noise_scale_of_its_last_part() -> None:
    """ZeRO's calls of one engine step make one record: the noise scale after the last call (the estimate is the
    step's, not a sum)."""
    parts = [
        StepRecord(3, False, 1, 1, 1, 0.0, 0.0, 1, 0, 10, None, None, noise_scale=None, noise_scale_voter_batches=2.0),
        StepRecord(3, False, 1, 1, 1, 0.0, 0.0, 1, 0, 10, None, None, noise_scale=None, noise_scale_voter_batches=2.5),
    ]
    combined = StepRecord.combined(parts)
    assert (combined.noise_scale, combined.noise_scale_voter_batches) == (None, 2.5)
    assert StepRecord.skipped_step(3).noise_scale_voter_batches is None
