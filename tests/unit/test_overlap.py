"""overlap=True: votes started from gradient hooks give the bits of the step without overlap, on thread ranks.

Each rank is a thread (tests/support/thread_world.py). The votes started during backward go over a
world of their own (as they go over a process group of their own in a real job) whose collectives
move data only when waited for. Every case trains the MLP of tests/support/scenarios.py with overlap
and without it, on the same batches and the same gradient edits (accumulation, clipping, a
parameter without a gradient on one rank, an inf on one rank), and requires bit-identical parameters
and momenta on every rank. The step without overlap is itself checked against the brute-force
simulation in test_bucket_schedule.py and the multi-process tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ds_lioncub import LionCub
from ds_lioncub.comm import wire
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from ds_lioncub.errors import LionCubConfigError, NonFiniteGradientError
from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_settings
from tests.support.thread_world import (
    DeferredThreadTransport,
    ThreadLionCub,
    ThreadTransport,
    ThreadWorld,
    on_every_rank,
)

MODES = {
    "1bit": {"compression": "1bit"},
    "4bit-sign": {"compression": "kbit", "bits": 4},
    "4bit-sign-alltoall-mean": {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall", "aggregation": "mean"},
    "8bit-l1": {"compression": "kbit", "bits": 8, "quantizer": "l1"},
}
STEPS = 6


def with_overlap_world(p: int) -> Callable[[ThreadWorld, int], ThreadTransport]:
    """Transports for ``on_every_rank`` whose ``overlap`` runs over a second thread world, deferred."""
    second = ThreadWorld(p)

    def make(world: ThreadWorld, rank: int) -> ThreadTransport:
        transport = ThreadTransport(world, rank)
        transport.overlap = DeferredThreadTransport(second, rank)  # type: ignore[attr-defined]
        return transport

    return make


def loss_without_b2(params: dict[str, torch.Tensor], rank: int, step: int) -> torch.Tensor:
    """The scenario loss with b2 left out: b2 gets no gradient (None) on the ranks that use it."""
    x, y = sc.batch(rank, step)
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] - y) ** 2).mean()


def train(
    transport: ThreadTransport,
    overlap: bool,
    options: dict[str, Any],
    accumulation: int = 1,
    clip: float | None = None,
    unused_b2_on_rank: int | None = None,
    inf_at: tuple[int, int] | None = None,
    bucket_size: int = sc.BUCKET_SIZE,
) -> dict[str, Any]:
    rank = transport.rank
    params = fresh_params()
    settings = scenario_settings(bucket_size=bucket_size, overlap=overlap, **options)
    optimizer = ThreadLionCub(transport, list(params.items()), **settings)

    def issued() -> int:
        return len(transport.overlap.issued) if overlap else 0  # type: ignore[attr-defined]

    launched_during_backward = []
    errors = []
    records = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            last = micro == accumulation - 1
            if overlap and last:
                optimizer.overlap_next_backward()
            before = issued()
            loss_fn = loss_without_b2 if rank == unused_b2_on_rank else sc.loss_of
            loss_fn(params, rank, 10 * step + micro).backward()
            if not last:
                assert issued() == before, "nothing is launched in a backward that was not armed"
        launched_during_backward.append(issued() - before)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        if inf_at == (rank, step):
            params["b1"].grad[0] = float("inf")
        try:
            optimizer.step()
            records.append(optimizer.last_step_telemetry)
        except NonFiniteGradientError as error:
            errors.append((step, str(error)))
    return {
        "params": [param.detach().clone() for param in params.values()],
        "momenta": [optimizer.state[param]["exp_avg"].clone() for param in params.values()],
        "revoted": optimizer.revoted_buckets,
        "launched_during_backward": launched_during_backward,
        "errors": errors,
        "records": records,
    }


def run_both(p: int, **case: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    plain = on_every_rank(p, lambda transport: train(transport, False, **case))
    overlapped = on_every_rank(p, lambda transport: train(transport, True, **case), with_overlap_world(p))
    return plain, overlapped


def assert_same_bits(plain: list[dict[str, Any]], overlapped: list[dict[str, Any]]) -> None:
    for rank, (off, on) in enumerate(zip(plain, overlapped, strict=True)):
        for index, name in enumerate(sc.PARAM_SHAPES):
            assert torch.equal(on["params"][index], off["params"][index]), f"rank {rank}: parameter {name}"
            assert torch.equal(on["momenta"][index], off["momenta"][index]), f"rank {rank}: momentum {name}"


@pytest.mark.parametrize("accumulation", (1, 2, 3))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", (2, 3))
def test_overlap_gives_the_same_bits_and_launches_every_bucket_during_backward(
    p: int, mode: str, accumulation: int
) -> None:
    plain, overlapped = run_both(p, options=MODES[mode], accumulation=accumulation)
    assert_same_bits(plain, overlapped)
    for result, off in zip(overlapped, plain, strict=True):
        assert result["revoted"] == 0, "unchanged gradients: every vote started in backward is kept"
        # 4 buckets of the MLP at bucket_size 1024; one first collective each, issued from the hooks
        assert result["launched_during_backward"] == [4] * STEPS
        for record, off_record in zip(result["records"], off["records"], strict=True):
            # Both take the noise scale's sketch (telemetry.noise_scale, on by default). Without overlap its
            # all-reduce carries the non-finite verdict; with overlap the verdict also says which buckets changed,
            # known only after the sketch (its factor may scale the gradients), so it keeps its own all-reduce.
            assert record.collectives == off_record.collectives + 1 and record.buckets == off_record.buckets == 4
            if mode == "1bit":
                # The step's telemetry counts the votes launched during its backward. The reverse plan's
                # buckets (584, 1024, 1024, 512 elements) pad differently from the forward plan's (1024,
                # 1024, 576, 520), and the verdict all-reduces [non-finite, 4 buckets], not one flag; the sketch
                # is one fp64 all-reduce of bins + 1, and one more number where it carries the verdict.
                noise = wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 1), p)
                on = sum(wire.vote_1bit_bytes(n, p) for n in (584, 1024, 1024, 512)) + wire.all_reduce_bytes(20, p)
                off_bytes = sum(wire.vote_1bit_bytes(n, p) for n in (1024, 1024, 576, 520))
                on, off_bytes = on + noise, off_bytes + wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), p)
                assert (record.bytes_sent, off_record.bytes_sent) == (on, off_bytes)


@pytest.mark.parametrize("mode", MODES)
def test_clipping_after_backward_is_caught_and_the_changed_buckets_voted_again(mode: str) -> None:
    plain, overlapped = run_both(3, options=MODES[mode], clip=0.05)
    assert_same_bits(plain, overlapped)
    assert all(result["revoted"] > 0 for result in overlapped), "clipping must have changed some messages"
    for result in overlapped:  # the step records say which buckets were voted again
        assert sum(record.revoted_buckets for record in result["records"]) == result["revoted"]


@pytest.mark.parametrize("bucket_size", (sc.BUCKET_SIZE, 1 << 23))
def test_a_parameter_without_gradient_on_one_rank_is_launched_at_step(bucket_size: int) -> None:
    plain, overlapped = run_both(3, options=MODES["1bit"], unused_b2_on_rank=1, bucket_size=bucket_size)
    assert_same_bits(plain, overlapped)


@pytest.mark.parametrize("mode", ("1bit", "8bit-l1"))
def test_an_inf_on_one_rank_stops_every_rank_and_the_next_steps_stay_exact(mode: str) -> None:
    plain, overlapped = run_both(3, options=MODES[mode], inf_at=(2, 3))
    assert_same_bits(plain, overlapped)
    for off, on in zip(plain, overlapped, strict=True):
        assert [step for step, _ in on["errors"]] == [step for step, _ in off["errors"]] == [3]
        assert on["errors"][0][1] == off["errors"][0][1]


def test_a_skipped_step_drains_and_the_tie_rule_follows_the_step_taken() -> None:
    """An armed backward whose step never comes: the next arm waits for and drops its votes."""

    def run(transport: ThreadTransport, overlap: bool) -> list[torch.Tensor]:
        params = fresh_params()
        optimizer = ThreadLionCub(transport, list(params.items()), lr=sc.TRAIN_LR, overlap=overlap)
        for step in range(1, 5):
            for attempt in range(2 if step == 2 else 1):  # step 2: the first backward is skipped
                optimizer.zero_grad()
                if overlap:
                    optimizer.overlap_next_backward()
                sc.loss_of(params, transport.rank, 10 * step + attempt).backward()
            optimizer.step()
        assert not optimizer.votes_in_flight
        return [param.detach().clone() for param in params.values()]

    plain = on_every_rank(2, lambda transport: run(transport, False))
    overlapped = on_every_rank(2, lambda transport: run(transport, True), with_overlap_world(2))
    for off, on in zip(plain, overlapped, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True))


def test_arming_without_the_option_is_refused() -> None:
    optimizer = LionCub(list(sc.init_params().items()))
    with pytest.raises(LionCubConfigError, match="overlap=True"):
        optimizer.overlap_next_backward()


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"compression": "none"}, "compression='1bit'"),
        ({"comm_backend_name": "mpi"}, "comm_backend_name='torch'"),
    ],
)
def test_overlap_refuses_what_it_cannot_do_before_training(options: dict[str, Any], fix: str) -> None:
    with pytest.raises(LionCubConfigError, match="overlap") as error:
        LionCub(list(sc.init_params().items()), overlap=True, **options)
    assert fix in str(error.value)


def test_a_world_of_one_arms_nothing_and_steps_as_without_overlap() -> None:
    results = []
    for overlap in (False, True):
        params = fresh_params()
        optimizer = LionCub(list(params.items()), lr=sc.TRAIN_LR, overlap=overlap)
        for step in range(1, 4):
            optimizer.zero_grad()
            if overlap:
                optimizer.overlap_next_backward()
                assert not optimizer.votes_in_flight
            sc.loss_of(params, 0, step).backward()
            optimizer.step()
        results.append([param.detach().clone() for param in params.values()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_save_checkpoint_between_an_armed_backward_and_its_step_is_refused() -> None:
    """DeepSpeed's save_checkpoint, as wrapped by ds_lioncub, on an engine whose LionCub has votes in flight."""
    from types import SimpleNamespace

    from ds_lioncub.integration.engine_hooks import _wrap_save_checkpoint

    def never_called(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("DeepSpeed's save must not start")

    save = _wrap_save_checkpoint(never_called)

    def run(transport: ThreadTransport) -> str:
        params = fresh_params()
        optimizer = ThreadLionCub(transport, list(params.items()), overlap=True)
        optimizer.overlap_next_backward()
        sc.loss_of(params, transport.rank, 1).backward()
        engine = SimpleNamespace(basic_optimizer=optimizer, global_steps=0)
        with pytest.raises(LionCubConfigError) as error:
            save(engine, "unused-dir")
        optimizer.discard_overlapped_votes()
        assert not optimizer.votes_in_flight
        return str(error.value)

    messages = on_every_rank(2, run, with_overlap_world(2))
    assert all("votes are in flight" in message and "after engine.step()" in message for message in messages)


def test_loading_a_checkpoint_drops_the_votes_of_an_armed_backward() -> None:
    """DeepSpeed's load_checkpoint, as wrapped by ds_lioncub: the votes belong to the state being replaced."""
    from types import SimpleNamespace

    from ds_lioncub.integration.engine_hooks import _wrap_load_checkpoint

    loads: list[str] = []

    def deepspeeds_load(engine: Any, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[None, dict[str, Any]]:
        loads.append(load_dir)
        return None, {}

    load = _wrap_load_checkpoint(deepspeeds_load)

    def run(transport: ThreadTransport) -> bool:
        params = fresh_params()
        optimizer = ThreadLionCub(transport, list(params.items()), overlap=True)
        optimizer.overlap_next_backward()
        sc.loss_of(params, transport.rank, 1).backward()
        in_flight_before = optimizer.votes_in_flight
        load(SimpleNamespace(basic_optimizer=optimizer), "unused-dir", load_optimizer_states=False)
        return in_flight_before and not optimizer.votes_in_flight

    assert on_every_rank(2, run, with_overlap_world(2)) == [True, True]
    assert loads == ["unused-dir", "unused-dir"]


def test_a_dropped_optimizer_leaves_no_gradient_hooks_behind() -> None:
    """The hooks hold the optimizer weakly: the model does not keep its momenta and groups alive."""
    import gc
    import weakref

    def run(transport: ThreadTransport) -> tuple[bool, int]:
        params = fresh_params()
        optimizer = ThreadLionCub(transport, list(params.items()), overlap=True)
        hooked = sum(len(param._post_accumulate_grad_hooks or {}) for param in params.values())
        alive = weakref.ref(optimizer)
        del optimizer
        gc.collect()
        sc.loss_of(params, transport.rank, 1).backward()  # no hook left to call into a dead optimizer
        left = sum(len(param._post_accumulate_grad_hooks or {}) for param in params.values())
        return alive() is None and hooked == len(params), left

    assert on_every_rank(2, run, with_overlap_world(2)) == [(True, 0), (True, 0)]
