"""CompressedBackend on 1-4 real gloo ranks, checked against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

import scenarios as sc
from reference import (
    brute_force_vote_1bit,
    brute_force_vote_kbit,
    max_world_size_allreduce,
    reference_compressed_allreduce,
)


def _same_on_every_rank(ranks: list[dict[str, object]], key: str) -> torch.Tensor:
    first = ranks[0][key]
    for rank, results in enumerate(ranks[1:], start=1):
        assert torch.equal(results[key], first), f"{key}: rank {rank} differs from rank 0"
    return first


def test_vote_1bit_equals_brute_force(ranks: list[dict[str, object]]) -> None:
    p = len(ranks)
    for size in sc.VOTE_SIZES:
        for step in sc.STEPS:
            for tie_break in ("alternate", "positive"):
                key = f"1bit/{size}/{step}/{tie_break}"
                got = _same_on_every_rank(ranks, key)
                inputs = [sc.vote_input(size, rank, step) for rank in range(p)]
                expected = brute_force_vote_1bit(inputs, step, tie_break)
                assert got.dtype == torch.float32 and got.shape == (size,)
                assert torch.equal(got, expected), key


def test_vote_1bit_ties_do_occur_and_follow_the_step(ranks: list[dict[str, object]]) -> None:
    """The inputs really exercise ties: a coordinate where every rank sends 0 follows the step's rule."""
    p = len(ranks)
    inputs = [sc.vote_input(1000, rank, 2) for rank in range(p)]
    all_zero = torch.stack(inputs).eq(0).all(dim=0)
    assert all_zero.any()
    assert torch.all(ranks[0]["1bit/1000/2/alternate"][all_zero] == -1)
    assert torch.all(ranks[0]["1bit/1000/2/positive"][all_zero] == 1)


def test_vote_1bit_bf16_keeps_dtype(ranks: list[dict[str, object]]) -> None:
    p = len(ranks)
    for size in sc.VOTE_SIZES:
        got = _same_on_every_rank(ranks, f"1bit-bf16/{size}")
        inputs = [sc.laplace_input(size, rank, 1).bfloat16() for rank in range(p)]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, brute_force_vote_1bit(inputs, 1, "alternate"))


def test_vote_1bit_sends_two_phases_of_packed_bits(ranks: list[dict[str, object]]) -> None:
    """Per rank: (p-1)/p * n_pad/8 bytes in the all-to-all plus the same in the all-gather."""
    p = len(ranks)
    for size in (1000, 4099):
        stats = ranks[0][f"1bit-stats/{size}/1/alternate"]
        padded = math.ceil(size / (8 * p)) * 8 * p
        expected = 2 * (p - 1) * padded // (8 * p)
        assert stats.bytes_sent == expected
        assert stats.collectives == (0 if p == 1 else 2)


def test_vote_kbit_equals_brute_force_or_refuses_before_communicating(ranks: list[dict[str, object]]) -> None:
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
            got = _same_on_every_rank(ranks, f"kbit/{name}/{step}")
            inputs = [sc.laplace_input(sc.KBIT_SIZE, rank, step) for rank in range(p)]
            segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
            expected = brute_force_vote_kbit(inputs, step, segment_sizes=segments, **case)
            # Exact: votes are ±1 and means are ratios of small integers rounded once.
            assert torch.equal(got, expected), f"{name} step {step}"
            small = _same_on_every_rank(ranks, f"kbit-small/{name}")
            small_expected = brute_force_vote_kbit([sc.laplace_input(5, r, 3) for r in range(p)], 3, **case)
            assert torch.equal(small, small_expected), f"{name} with 5 elements"
            checked += 1
    assert checked > 0
    if p >= 2:
        assert refused > 0


def test_vote_kbit_allreduce_sends_one_packed_sum(ranks: list[dict[str, object]]) -> None:
    p = len(ranks)
    if p == 1:
        pytest.skip("a world of one sends nothing")
    stats = ranks[0]["kbit-stats/4-sign-vote-allreduce/1"]
    packed = math.ceil(sc.KBIT_SIZE * 4 / 8)
    assert stats.collectives == 1
    assert stats.bytes_sent == 2 * (p - 1) * packed // p


def test_compressed_allreduce_matches_reference_simulation(ranks: list[dict[str, object]]) -> None:
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
        _same_on_every_rank(ranks, f"legacy/{call}/out")
