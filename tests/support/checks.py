"""Checks of a multi-rank job's results against the brute-force references, shared by every transport's tests.

A job's results are one dict per rank, keyed by scenario. The gloo jobs (tests/workers/run_scenarios.py)
and the MPI jobs (tests/workers/mpi_scenarios.py, once per transport) record the same scenarios under the
same keys, so tests/distributed and tests/integration/test_mpi.py run the same assertions on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import torch

from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from tests.support import scenarios as sc
from tests.support.reference import (
    brute_force_vote_1bit,
    brute_force_vote_kbit,
    brute_force_vote_stats_for_options,
    max_world_size_allreduce,
    reference_bucket_sizes,
    reference_compressed_allreduce,
)

Ranks = list[dict[str, Any]]
PARAM_NAMES = list(sc.PARAM_SHAPES)


def trained_mode_equals_reference(
    ranks: Ranks,
    prefix: str,
    mode: str,
    params: list[torch.Tensor],
    momenta: list[list[torch.Tensor]],
    virtual: dict[str, Any],
) -> None:
    """``mode``, trained by the gloo jobs under keys starting with ``prefix``, against a plain loop's ``params`` and
    per-rank ``momenta`` and the virtual world's results ``virtual``, bit for bit: every rank's parameters (pipelined
    and serial bucket schedules) and final momenta; every parameter moved."""
    init = sc.init_params()
    for index, name in enumerate(sc.PARAM_SHAPES):
        want = params[index]
        assert not torch.equal(want, init[name]), f"{mode}: {name} never moved"
        assert torch.equal(virtual[f"param/{name}"], want), f"{mode}: the virtual world's {name}"
        for rank, results in enumerate(ranks):
            for schedule in ("train", "train-serial"):
                got = results[f"{prefix}{schedule}-param/{mode}/{name}"]
                assert torch.equal(got, want), f"{mode} ({schedule}): {name} on rank {rank}"
            momentum = results[f"{prefix}train-exp-avg/{mode}/final/{name}"]
            # Exact Lion's momentum is every rank's; a plain loop keeps it per rank all the same.
            assert torch.equal(momentum, momenta[rank][index].view_as(momentum)), f"{mode}: {rank} {name}"
            assert torch.equal(virtual[f"exp-avg/{rank}/{sc.TRAIN_STEPS}/{name}"], momentum)


def same_on_every_rank(ranks: Ranks, key: str) -> torch.Tensor:
    """``ranks[0][key]``, after asserting that every rank holds the same bits."""
    first = ranks[0][key]
    for rank, results in enumerate(ranks[1:], start=1):
        assert torch.equal(results[key], first), f"{key}: rank {rank} differs from rank 0"
    return first


def same_message_on_every_rank(ranks: Ranks, key: str) -> str:
    """The error message every rank recorded under ``key``, after asserting it is one message, not an acceptance."""
    messages = {results[key] for results in ranks}
    assert len(messages) == 1, f"{key}: the ranks recorded different outcomes: {messages}"
    message = messages.pop()
    assert message is not None, f"{key}: accepted where an error was expected"
    return str(message)


# ---------------------------------------------------------------------------------------------- CompressedBackend


def vote_1bit_equals_brute_force(ranks: Ranks) -> None:
    p = len(ranks)
    for size in sc.VOTE_SIZES:
        for step in sc.STEPS:
            for tie_break in ("alternate", "positive"):
                key = f"1bit/{size}/{step}/{tie_break}"
                got = same_on_every_rank(ranks, key)
                inputs = [sc.vote_input(size, rank, step) for rank in range(p)]
                expected = brute_force_vote_1bit(inputs, step, tie_break)
                assert got.dtype == torch.float32 and got.shape == (size,)
                assert torch.equal(got, expected), key


def vote_1bit_ties_follow_the_step(ranks: Ranks) -> None:
    """The inputs really exercise ties: a coordinate where every rank sends 0 follows the step's rule."""
    p = len(ranks)
    inputs = [sc.vote_input(1000, rank, 2) for rank in range(p)]
    all_zero = torch.stack(inputs).eq(0).all(dim=0)
    assert all_zero.any()
    assert torch.all(ranks[0]["1bit/1000/2/alternate"][all_zero] == -1)
    assert torch.all(ranks[0]["1bit/1000/2/positive"][all_zero] == 1)


def vote_1bit_bf16_keeps_dtype(ranks: Ranks) -> None:
    p = len(ranks)
    for size in sc.VOTE_SIZES:
        got = same_on_every_rank(ranks, f"1bit-bf16/{size}")
        inputs = [sc.laplace_input(size, rank, 1).bfloat16() for rank in range(p)]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, brute_force_vote_1bit(inputs, 1, "alternate"))


def vote_1bit_sends_two_phases_of_packed_bits(ranks: Ranks) -> None:
    """Per rank: (p-1)/p * n_pad/8 bytes in the all-to-all plus the same in the all-gather."""
    p = len(ranks)
    for size in (1000, 4099):
        stats = ranks[0][f"1bit-stats/{size}/1/alternate"]
        padded = math.ceil(size / (8 * p)) * 8 * p
        expected = 2 * (p - 1) * padded // (8 * p)
        assert stats.bytes_sent == expected
        assert stats.collectives == (0 if p == 1 else 2)


def vote_kbit_equals_brute_force_or_refuses_before_communicating(ranks: Ranks) -> None:
    p = len(ranks)
    checked = refused = 0
    for case in sc.kbit_cases(p):
        name = sc.case_name(case)
        fits = case["algorithm"] == "alltoall" or p <= max_world_size_allreduce(case["bits"], case["quantizer"])
        for step in sc.STEPS:
            stats = ranks[0][f"kbit-stats/{name}/{step}"]
            if not fits:
                messages = {results[f"kbit-error/{name}/{step}"] for results in ranks}
                assert len(messages) == 1, "every rank must raise the same error"
                message = messages.pop()
                largest = max_world_size_allreduce(case["bits"], case["quantizer"])
                assert f"at most {largest} workers" in message and "alltoall" in message
                assert stats.collectives == 0
                refused += 1
                continue
            got = same_on_every_rank(ranks, f"kbit/{name}/{step}")
            inputs = [sc.laplace_input(sc.KBIT_SIZE, rank, step) for rank in range(p)]
            segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
            expected = brute_force_vote_kbit(inputs, step, segment_sizes=segments, **case)
            # Exact: votes are ±1 and means are ratios of small integers rounded once.
            assert torch.equal(got, expected), f"{name} step {step}"
            small = same_on_every_rank(ranks, f"kbit-small/{name}")
            small_expected = brute_force_vote_kbit([sc.laplace_input(5, r, 3) for r in range(p)], 3, **case)
            assert torch.equal(small, small_expected), f"{name} with 5 elements"
            checked += 1
    assert checked > 0
    if p >= 2:
        assert refused > 0


def vote_kbit_allreduce_sends_one_packed_sum(ranks: Ranks) -> None:
    """One uint8 all-reduce of the packed 4-bit fields (a world of more than one rank)."""
    p = len(ranks)
    assert p > 1, "a world of one sends nothing"
    stats = ranks[0]["kbit-stats/4-sign-vote-allreduce/1"]
    packed = math.ceil(sc.KBIT_SIZE * 4 / 8)
    assert stats.collectives == 1
    assert stats.bytes_sent == 2 * (p - 1) * packed // p


def compressed_allreduce_matches_reference_simulation(ranks: Ranks) -> None:
    """Three consecutive calls, so the worker and server error buffers carry over."""
    p = len(ranks)
    numel = torch.Size(sc.LEGACY_SHAPE).numel()
    padded = math.ceil(numel / (p * math.lcm(p, 8))) * p * math.lcm(p, 8)
    worker_errors = [torch.zeros(padded) for _ in range(p)]
    server_errors = [torch.zeros(padded // p) for _ in range(p)]
    for call in range(sc.LEGACY_CALLS):
        buffers = [sc.legacy_input(rank, call) for rank in range(p)]
        outs, worker_errors, server_errors = reference_compressed_allreduce(
            buffers, worker_errors, server_errors, compute_dtype=torch.float32
        )
        for rank in range(p):
            got = ranks[rank]
            assert got[f"legacy/{call}/same-object"] is True
            out = got[f"legacy/{call}/out"]
            assert out.shape == sc.LEGACY_SHAPE
            torch.testing.assert_close(out, outs[rank], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[f"legacy/{call}/worker_error"], worker_errors[rank], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[f"legacy/{call}/server_error"], server_errors[rank], rtol=1e-5, atol=1e-6)
        same_on_every_rank(ranks, f"legacy/{call}/out")


def segmented_collectives_deliver_every_ranks_message(ranks: Ranks) -> None:
    """gloo collectives cut into 7-byte segments: each rank gets every rank's bytes, counted once."""
    p = len(ranks)
    expected_sent = 0
    for size in sc.SEGMENTED_SIZES:
        messages = [sc.byte_message(size * p, rank) for rank in range(p)]
        for rank, results in enumerate(ranks):
            # all-to-all: row r of what rank `rank` receives is rank r's row `rank`
            expected = torch.cat([message.view(p, size)[rank] for message in messages])
            assert torch.equal(results[f"seg-a2a/{size}"], expected)
            assert torch.equal(results[f"seg-a2a-issued/{size}"], expected)
            gathered = torch.cat([message[:size] for message in messages])
            assert torch.equal(results[f"seg-ag/{size}"], gathered)
            assert torch.equal(results[f"seg-ag-issued/{size}"], gathered)
        expected_sent += 2 * wire.all_to_all_bytes(size * p, p) + 2 * wire.all_gather_bytes(size, p)
    for results in ranks:
        assert results["seg-stats/collectives"] == (4 * len(sc.SEGMENTED_SIZES) if p > 1 else 0)
        assert results["seg-stats/bytes_sent"] == expected_sent


def segmented_votes_equal_brute_force(ranks: Ranks) -> None:
    """Votes in pipeline chunks over segmented gloo collectives: the brute-force votes, on every rank."""
    p = len(ranks)
    inputs = [sc.laplace_input(sc.KBIT_SIZE, rank, 1) for rank in range(p)]
    assert torch.equal(same_on_every_rank(ranks, "seg-1bit"), brute_force_vote_1bit(inputs, 1))
    inputs = [sc.laplace_input(sc.KBIT_SIZE, rank, 2) for rank in range(p)]
    for case in sc.SEGMENTED_KBIT_CASES:
        if case["algorithm"] == "allreduce" and p > max_world_size_allreduce(case["bits"], case["quantizer"]):
            continue
        segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
        expected = brute_force_vote_kbit(inputs, 2, segment_sizes=segments, **case)
        assert torch.equal(same_on_every_rank(ranks, f"seg-kbit/{sc.case_name(case)}"), expected), case


# Every backend check (the k-bit all-reduce byte count needs a world of more than one rank).
BACKEND_CHECKS: tuple[Callable[[Ranks], None], ...] = (
    vote_1bit_equals_brute_force,
    vote_1bit_ties_follow_the_step,
    vote_1bit_bf16_keeps_dtype,
    vote_1bit_sends_two_phases_of_packed_bits,
    vote_kbit_equals_brute_force_or_refuses_before_communicating,
    vote_kbit_allreduce_sends_one_packed_sum,
    compressed_allreduce_matches_reference_simulation,
)


# ---------------------------------------------------------------------------------------------- LionCub training

# Modes whose parameters equal the simulation bit for bit whatever the order of floating-point sums:
# signs, votes and integer field sums (the mean modes divide sums, the "none" modes average gradients).
ORDER_FREE_MODES = frozenset(
    {
        "none-fp32",
        "1bit",
        "1bit-positive",
        "4bit-sign",
        "4bit-sign-alltoall",
        "8bit-l1",
        "4bit-l1-alltoall",
        "2bit-sign",
        "1bit-sync",
    }
)


def parameters_identical_on_every_rank(ranks: Ranks) -> None:
    for mode in sc.training_modes(len(ranks)):
        for name in PARAM_NAMES:
            key = f"train-param/{mode}/{name}"
            for rank, results in enumerate(ranks[1:], start=1):
                assert torch.equal(results[key], ranks[0][key]), f"{key}: rank {rank} differs"


def pipelined_buckets_match_serial_buckets(ranks: Ranks) -> None:
    """Every compressed mode's parameters and momenta, buckets pipelined vs one by one, bit for bit on every rank."""
    for mode, options in sc.training_modes(len(ranks)).items():
        if options["compression"] == "none":
            continue
        for rank, results in enumerate(ranks):
            for name in PARAM_NAMES:
                for kind in ("param", "exp-avg"):
                    suffix = name if kind == "param" else f"final/{name}"
                    pipelined = results[f"train-{kind}/{mode}/{suffix}"]
                    serial = results[f"train-serial-{kind}/{mode}/{suffix}"]
                    assert torch.equal(pipelined, serial), f"{mode}: rank {rank} {kind} {name}"
            stats = [results[f"train-stats/{mode}/{step}"] for step in range(1, sc.TRAIN_STEPS + 1)]
            serial_stats = [results[f"train-serial-stats/{mode}/{step}"] for step in range(1, sc.TRAIN_STEPS + 1)]
            assert stats == serial_stats, f"{mode}: rank {rank} counts different traffic"


def training_matches_brute_force_simulation(ranks: Ranks, exact_modes: Collection[str] | None) -> None:
    """Every mode's parameters (rank 0) and every rank's final momenta against :func:`scenarios.simulate_mode`.

    ``exact_modes``: the modes compared bit for bit, parameters only; the others within an ulp's tolerance
    (summation order), momenta always with a tolerance. ``None``: everything bit for bit (a transport that
    sums floats in the simulation's rank order). bf16 gradient averaging is left out: the simulation averages
    in fp32.
    """
    p = len(ranks)
    init = sc.init_params()
    for mode, options in sc.training_modes(p).items():
        if mode == "none-bf16":
            continue
        expected_params, expected_momenta = sc.simulate_mode(p, options)
        for index, name in enumerate(PARAM_NAMES):
            got = ranks[0][f"train-param/{mode}/{name}"]
            assert not torch.equal(got, init[name]), f"{mode}: {name} never moved"
            if exact_modes is None or mode in exact_modes:
                assert torch.equal(got, expected_params[index]), f"{mode}: {name}"
            else:  # averaged gradients or means: the summation order may differ by an ulp
                torch.testing.assert_close(got, expected_params[index], rtol=1e-5, atol=1e-6)
            for rank in range(p):
                momentum = ranks[rank][f"train-exp-avg/{mode}/final/{name}"]
                if exact_modes is None:
                    assert torch.equal(momentum, expected_momenta[rank][index]), f"{mode}: rank {rank} {name}"
                else:
                    torch.testing.assert_close(momentum, expected_momenta[rank][index], rtol=1e-5, atol=1e-7)


def expected_training_traffic(options: dict[str, Any], world_size: int, step: int) -> tuple[int, int]:
    """(collectives, bytes sent) per rank in one standalone training step of a :func:`scenarios.training_modes`
    mode: docs/design.md section 14's list of collectives, each priced by the wire formulas of
    ds_lioncub/comm/wire.py for the bucket sizes of section 9 (reference_bucket_sizes)."""
    p = world_size
    if p == 1:
        return 0, 0
    numels = [torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values()]
    buckets = reference_bucket_sizes(numels, sc.BUCKET_SIZE)
    compression = options["compression"]
    if compression == "none":
        element_size = 2 if options.get("comm_dtype") == "bf16" else 4
        return len(buckets), sum(wire.dense_all_reduce_bytes(n, p, element_size) for n in buckets)
    telemetry = options.get("telemetry")
    if not (isinstance(telemetry, dict) and telemetry.get("noise_scale") is False):
        # The gradient noise scale (telemetry.noise_scale, on by default): the sketch and the squared norm, fp64,
        # and one more number that carries the non-finite check's verdict (no int32 all-reduce of its own).
        collectives, sent = 1, wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), p)
    else:
        collectives, sent = 1, wire.all_reduce_bytes(4, p)  # the non-finite check's int32 count
    if compression == "1bit":
        collectives += 2 * len(buckets)
        sent += sum(wire.vote_1bit_bytes(n, p) for n in buckets)
    else:
        algorithm = str(options.get("kbit_algorithm", "allreduce"))
        codec = KbitCodec.build(p, int(options["bits"]), options.get("quantizer", "sign"), algorithm)  # type: ignore[arg-type]
        collectives += (1 if algorithm == "allreduce" else 2) * len(buckets)
        sent += sum(wire.kbit_bytes(n, codec, options.get("aggregation", "vote")) for n in buckets)  # type: ignore[arg-type]
    sync = options.get("momentum_sync")
    if isinstance(sync, dict) and step % sync["interval"] == 0:
        synced = [numel for name, numel in zip(sc.PARAM_SHAPES, numels, strict=True) if name == "w2"]
        sync_buckets = reference_bucket_sizes(synced, sc.BUCKET_SIZE)
        collectives += len(sync_buckets)
        sent += sum(wire.dense_all_reduce_bytes(n, p, 4) for n in sync_buckets)
    return collectives, sent


def telemetry_counts_the_traffic(ranks: Ranks) -> None:
    """Every step's record: the comm_stats() difference across the step, and the wire formulas' count."""
    p = len(ranks)
    numels = [torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values()]
    for mode, options in sc.training_modes(p).items():
        for rank, results in enumerate(ranks):
            for step in range(1, sc.TRAIN_STEPS + 1):
                record = results[f"train-telemetry/{mode}/{step}"]
                delta = results[f"train-stats/{mode}/{step}"]
                where = f"{mode} rank {rank} step {step}"
                collectives, sent = expected_training_traffic(options, p, step)
                assert (record.step, record.skipped, record.revoted_buckets) == (step, False, 0), where
                assert (record.collectives, record.bytes_sent, record.bytes_received) == (
                    delta.collectives,
                    delta.bytes_sent,
                    delta.bytes_received,
                ), where
                assert (record.collectives, record.bytes_sent, record.bytes_received) == (collectives, sent, sent), (
                    where
                )
                assert (record.comm_seconds > 0) == (collectives > 0) and record.comm_seconds >= 0, where
                aggregates = p > 1 or options["compression"] != "none"
                assert (record.buckets > 0) == aggregates and (record.local_seconds > 0) == aggregates, where
                voted = sum(numels) if options["compression"] != "none" else 0
                assert record.voted_elements == voted, where
            totals = results[f"train-telemetry-totals/{mode}"]
            steps = [results[f"train-telemetry/{mode}/{step}"] for step in range(1, sc.TRAIN_STEPS + 1)]
            assert (totals.steps, totals.skipped_steps) == (sc.TRAIN_STEPS, 0), mode
            assert totals.bytes_sent == sum(record.bytes_sent for record in steps), mode
            assert totals.collectives == sum(record.collectives for record in steps), mode


def telemetry_vote_rates_equal_brute_force(ranks: Ranks) -> None:
    """tie_rate and agreement_rate of every step against brute_force_vote_stats on every rank's c."""
    p = len(ranks)
    numels = [torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values()]
    measured = 0
    for mode, options in sc.training_modes(p).items():
        vote_stats = options.get("telemetry") == {"vote_stats": True}
        updates: list[list[torch.Tensor]] = []
        if vote_stats:
            sc.simulate_mode(p, options, pre_sign_updates=updates)
        for step in range(1, sc.TRAIN_STEPS + 1):
            records = [results[f"train-telemetry/{mode}/{step}"] for results in ranks]
            if not vote_stats:
                assert all(r.tie_rate is None and r.agreement_rate is None for r in records), mode
                continue
            expected = brute_force_vote_stats_for_options(updates[step - 1], step, options, numels, sc.BUCKET_SIZE)
            for rank, record in enumerate(records):
                where = f"{mode} rank {rank} step {step}"
                assert record.tie_rate == expected.tie_rate, where
                assert record.agreement_rate == expected.agreement_rates[rank], where
            measured += 1
    assert measured >= 5 * sc.TRAIN_STEPS
