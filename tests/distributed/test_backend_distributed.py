"""CompressedBackend on 1-4 real gloo ranks, checked against brute-force references (tests/support/checks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import checks

pytestmark = pytest.mark.distributed


def test_vote_1bit_equals_brute_force(ranks: list[dict[str, Any]]) -> None:
    checks.vote_1bit_equals_brute_force(ranks)


def test_vote_1bit_ties_do_occur_and_follow_the_step(ranks: list[dict[str, Any]]) -> None:
    checks.vote_1bit_ties_follow_the_step(ranks)


def test_vote_1bit_bf16_keeps_dtype(ranks: list[dict[str, Any]]) -> None:
    checks.vote_1bit_bf16_keeps_dtype(ranks)


def test_vote_1bit_sends_two_phases_of_packed_bits(ranks: list[dict[str, Any]]) -> None:
    checks.vote_1bit_sends_two_phases_of_packed_bits(ranks)


def test_vote_kbit_equals_brute_force_or_refuses_before_communicating(ranks: list[dict[str, Any]]) -> None:
    checks.vote_kbit_equals_brute_force_or_refuses_before_communicating(ranks)


def test_vote_kbit_allreduce_sends_one_packed_sum(ranks: list[dict[str, Any]]) -> None:
    if len(ranks) == 1:
        pytest.skip("a world of one sends nothing")
    checks.vote_kbit_allreduce_sends_one_packed_sum(ranks)


def test_compressed_allreduce_matches_reference_simulation(ranks: list[dict[str, Any]]) -> None:
    checks.compressed_allreduce_matches_reference_simulation(ranks)


def test_segmented_gloo_collectives_deliver_every_ranks_message(ranks: list[dict[str, Any]]) -> None:
    checks.segmented_collectives_deliver_every_ranks_message(ranks)


def test_votes_over_segmented_gloo_collectives_equal_brute_force(ranks: list[dict[str, Any]]) -> None:
    checks.segmented_votes_equal_brute_force(ranks)
