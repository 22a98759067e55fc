"""What the aggregations answer for themselves: their state, tied counts, and the questions callers ask.

The tied counts run on 1 to 4 virtual ranks (ds_lioncub.simulate.transport: the library's collectives
in one process) and are checked against a brute-force count written here: a position is tied when the
ranks' integer votes (resolved signs, or L1 levels) sum to 0.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import pytest
import torch

from ds_lioncub.aggregation import (
    AggregationState,
    Aggregator,
    Bucket,
    ExactMean,
    ExactMeanState,
    KbitVote,
    KbitVoteState,
    OneBitVote,
    OneBitVoteState,
    build_aggregation,
    packed_sign_vote,
)
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.votes import count_set_bits
from ds_lioncub.config import parse_config
from ds_lioncub.simulate.transport import VirtualNetwork
from ds_lioncub.telemetry import count_tied_votes
from tests.support.reference import l1_levels, l1_quantize, max_world_size_allreduce

NUMEL = 1001  # not a multiple of 8p: the padding must not count as ties


def rank_updates(world_size: int, seed: int) -> list[torch.Tensor]:
    """Updates with many exact zeros and small integers, so that many positions tie."""
    generator = torch.Generator().manual_seed(seed)
    updates = []
    for _ in range(world_size):
        values = torch.randint(-2, 3, (NUMEL,), generator=generator).float()
        values *= torch.rand(NUMEL, generator=generator) + 0.5
        updates.append(values)
    return updates


def brute_force_ties(integer_votes: list[torch.Tensor]) -> int:
    """Positions whose votes sum to 0, one position at a time."""
    count = 0
    for position in range(NUMEL):
        if sum(int(votes[position]) for votes in integer_votes) == 0:
            count += 1
    return count


def resolved_signs(update: torch.Tensor, positive_ties: bool) -> torch.Tensor:
    signs = torch.sign(update).to(torch.int64)
    signs[signs == 0] = 1 if positive_ties else -1
    return signs


def finish_on_every_rank(aggregators: Sequence[Aggregator], pending: list[object]) -> None:
    """Each later stage on every virtual rank in turn (a rank waits only for collectives all have issued)."""
    results = [aggregator.reduce(mine) for aggregator, mine in zip(aggregators, pending, strict=True)]
    for aggregator, result in zip(aggregators, results, strict=True):
        aggregator.complete(result)


def tied_counts_on_ranks(
    make: type[OneBitVote] | type[KbitVote], world_size: int, positive_ties: bool, **kbit: str | int
) -> tuple[list[int], list[bool], list[torch.Tensor]]:
    network = VirtualNetwork(world_size)
    aggregators: list[Aggregator] = []
    for transport in network.transports:
        if make is OneBitVote:
            aggregators.append(OneBitVote(transport))
        else:
            codec = KbitCodec.build(world_size, int(kbit["bits"]), str(kbit["quantizer"]), str(kbit["algorithm"]))  # type: ignore[arg-type]
            aggregators.append(KbitVote(transport, codec, str(kbit["aggregation"]), 2.0))  # type: ignore[arg-type]
    updates = rank_updates(world_size, seed=world_size * 7 + int(positive_ties))
    pending = [
        aggregator.start(Bucket(update.clone(), [NUMEL], [None]), positive_ties)
        for aggregator, update in zip(aggregators, updates, strict=True)
    ]
    counts, shares = [], []
    for aggregator, mine in zip(aggregators, pending, strict=True):
        count, owner_share = aggregator.tied_counts(mine)
        assert count.dtype == torch.int64 and count.numel() == 1
        again, _ = count_tied_votes(aggregator, mine)  # the telemetry asks the aggregation
        assert torch.equal(again, count)
        counts.append(int(count))
        shares.append(owner_share)
    finish_on_every_rank(aggregators, pending)
    return counts, shares, updates


def total_ties(counts: list[int], shares: list[bool]) -> int:
    assert len(set(shares)) == 1
    if shares[0]:
        return sum(counts)  # the chunk owners' shares add up to the bucket's
    assert len(set(counts)) == 1  # every rank holds the bucket's whole count
    return counts[0]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("positive_ties", [True, False])
def test_one_bit_tied_counts_match_a_brute_force_count(world_size: int, positive_ties: bool) -> None:
    counts, shares, updates = tied_counts_on_ranks(OneBitVote, world_size, positive_ties)
    expected = brute_force_ties([resolved_signs(update, positive_ties) for update in updates])
    assert all(shares)
    assert total_ties(counts, shares) == expected
    if world_size % 2 == 0:
        assert expected > 0  # the case is not vacuous


KBIT_CASES = [
    (world_size, bits, quantizer, algorithm, aggregation)
    for world_size in (1, 2, 3, 4)
    for bits in (2, 4, 8)
    for quantizer in ("sign", "l1")
    for algorithm in ("allreduce", "alltoall")
    for aggregation in ("vote", "mean")
    if algorithm == "alltoall" or world_size <= max_world_size_allreduce(bits, quantizer)
    if quantizer == "sign" or l1_levels(world_size, bits, algorithm) >= 1
]


@pytest.mark.parametrize(("world_size", "bits", "quantizer", "algorithm", "aggregation"), KBIT_CASES)
@pytest.mark.parametrize("positive_ties", [True, False])
def test_kbit_tied_counts_match_a_brute_force_count(
    world_size: int, bits: int, quantizer: str, algorithm: str, aggregation: str, positive_ties: bool
) -> None:
    counts, shares, updates = tied_counts_on_ranks(
        KbitVote,
        world_size,
        positive_ties,
        bits=bits,
        quantizer=quantizer,
        algorithm=algorithm,
        aggregation=aggregation,
    )
    if quantizer == "sign":
        votes = [resolved_signs(update, positive_ties) for update in updates]
    else:
        levels = l1_levels(world_size, bits, algorithm)
        votes = [l1_quantize(update, levels, 2.0).to(torch.int64) for update in updates]
    assert all(share == (algorithm == "alltoall") for share in shares)
    assert total_ties(counts, shares) == brute_force_ties(votes)


def test_exact_mean_takes_no_vote() -> None:
    mean = ExactMean(VirtualNetwork(2).transports[0])
    assert not mean.votes_packed_signs and not mean.votes_during_backward
    with pytest.raises(TypeError, match="ExactMean takes no vote"):
        mean.tied_counts(object())
    with pytest.raises(TypeError, match="ExactMean takes no vote"):
        count_tied_votes(mean, object())  # type: ignore[arg-type]
    for call, arguments in (
        (mean.pack, (Bucket(torch.zeros(8), [8], []), True)),
        (mean.issue, (torch.zeros(1, dtype=torch.uint8), 8, True)),
        (mean.sign_message_layout, (8,)),
        (mean.complete_packed, (object(),)),
    ):
        with pytest.raises(ValueError, match="for votes"):
            call(*arguments)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("options", "packed_signs"),
    [
        ({"compression": "1bit"}, True),
        ({"compression": "kbit", "bits": 4, "quantizer": "sign", "aggregation": "vote"}, True),
        ({"compression": "kbit", "bits": 4, "quantizer": "sign", "aggregation": "mean"}, False),
        ({"compression": "kbit", "bits": 8, "quantizer": "l1", "aggregation": "vote"}, False),
    ],
)
def test_votes_answer_the_callers_questions(options: dict[str, object], packed_signs: bool) -> None:
    vote = build_aggregation(parse_config(options), VirtualNetwork(2).transports[0], False)
    assert vote is not None
    assert vote.votes_packed_signs is packed_signs
    assert vote.votes_during_backward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert packed_sign_vote(vote) is (vote if packed_signs else None)  # the deprecated alias still answers
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_state_objects_hold_the_knobs() -> None:
    transport = VirtualNetwork(3).transports[0]
    assert isinstance(ExactMean(transport, torch.bfloat16).state, ExactMeanState)
    assert ExactMean(transport, torch.bfloat16).state.knobs() == {"comm_dtype": "torch.bfloat16"}
    assert isinstance(OneBitVote(transport).state, OneBitVoteState)
    assert OneBitVote(transport).state.knobs() == {}
    codec = KbitCodec.build(3, 8, "l1", "alltoall")
    kbit = KbitVote(transport, codec, "mean", 3.0)
    assert isinstance(kbit.state, KbitVoteState)
    assert kbit.state.knobs() == {
        "bits": 8,
        "quantizer": "l1",
        "algorithm": "alltoall",
        "aggregation": "mean",
        "l1_clip": 3.0,
    }
    assert (kbit.codec, kbit.aggregation, kbit.l1_clip) == (codec, "mean", 3.0)  # read from the state


def test_state_counts_the_buckets_issued() -> None:
    network = VirtualNetwork(2)
    votes = [OneBitVote(transport) for transport in network.transports]
    for step in range(3):
        pending = [vote.start(Bucket(torch.randn(40), [40], []), step % 2 == 0) for vote in votes]
        finish_on_every_rank(votes, pending)
    assert [vote.state.issued for vote in votes] == [3, 3]


@pytest.mark.parametrize(
    "make",
    [
        lambda transport: ExactMean(transport, torch.float32),
        OneBitVote,
        lambda transport: KbitVote(transport, KbitCodec.build(2, 4, "sign", "allreduce"), "vote", 2.0),
    ],
)
def test_state_dict_round_trip(make: object) -> None:
    transport = VirtualNetwork(2).transports[0]
    first: Aggregator = make(transport)  # type: ignore[operator]
    first.state.issued = 5
    residual = torch.randn(16)
    first.state.buckets[(1, 0)] = {"residual": residual}
    saved = first.state.state_dict()
    second: Aggregator = make(transport)  # type: ignore[operator]
    second.state.load_state_dict(saved)
    assert second.state.issued == 5
    assert list(second.state.buckets) == [(1, 0)] and torch.equal(second.state.buckets[(1, 0)]["residual"], residual)
    assert second.state.state_dict()["knobs"] == saved["knobs"]
    # Through torch.save and torch.load, as a checkpoint would carry it.
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    third: Aggregator = make(transport)  # type: ignore[operator]
    third.state.load_state_dict(torch.load(buffer, weights_only=True))
    assert third.state.state_dict()["issued"] == 5


def test_load_state_dict_refuses_other_knobs_or_kinds() -> None:
    transport = VirtualNetwork(2).transports[0]
    fp32 = ExactMean(transport, torch.float32).state.state_dict()
    with pytest.raises(ValueError, match="cannot load"):
        ExactMean(transport, torch.bfloat16).state.load_state_dict(fp32)
    with pytest.raises(ValueError, match="cannot load"):
        OneBitVote(transport).state.load_state_dict(fp32)
    sign = KbitVote(transport, KbitCodec.build(2, 4, "sign", "allreduce"), "vote", 2.0).state.state_dict()
    with pytest.raises(ValueError, match="cannot load"):
        KbitVote(transport, KbitCodec.build(2, 4, "sign", "alltoall"), "vote", 2.0).state.load_state_dict(sign)


def test_base_state_is_empty() -> None:
    state = AggregationState()
    assert state.state_dict() == {"kind": "AggregationState", "knobs": {}, "issued": 0, "buckets": {}}


def test_count_set_bits_is_a_popcount() -> None:
    packed = torch.randint(0, 256, (300,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert int(count_set_bits(packed)) == sum(bin(int(value)).count("1") for value in packed)
