"""The aggregations built from a config, in a world of one (torch.distributed not initialised).

Alone, a vote is the rank's own sign with the tie rule, and a k-bit sum is the rank's own field, so
every aggregation is checked against the brute-force oracle of tests/reference.py. Multi-rank
behaviour is checked through the optimizer by the distributed tests.
"""

from __future__ import annotations

import pytest
import torch

from ds_lioncub.aggregation import Bucket, ExactMean, KbitVote, OneBitVote, build_aggregation
from ds_lioncub.comm.transport import TorchTransport
from ds_lioncub.config import parse_config
from tests.support.reference import brute_force_vote_1bit, brute_force_vote_kbit, l1_quantize, tie_value

PIECES = [700, 3, 0, 300]  # no 1-element piece: its |c| / mu == 1 puts L1 exactly on a rounding tie


def pre_sign_update(seed: int) -> torch.Tensor:
    """A heavy-tailed update with exact zeros (ties) in it."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(PIECES), generator=generator) * torch.rand(sum(PIECES), generator=generator).pow(3)
    values[::17] = 0.0
    return values


def alone() -> TorchTransport:
    transport = TorchTransport()
    assert transport.world_size == 1
    return transport


def test_build_chooses_the_aggregation_the_options_name() -> None:
    transport = alone()
    assert build_aggregation(parse_config({"compression": "none"}), transport, gradients_averaged=False) is None
    assert build_aggregation(parse_config({"compression": "none"}), transport, gradients_averaged=True) is None
    assert isinstance(build_aggregation(parse_config({"compression": "1bit"}), transport, False), OneBitVote)
    kbit = build_aggregation(parse_config({"compression": "kbit", "bits": 8, "quantizer": "l1"}), transport, False)
    assert isinstance(kbit, KbitVote) and kbit.codec.levels == 127 and kbit.needs_whole_tensor_mean_abs


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("tie_break", ["alternate", "positive"])
def test_one_bit_vote_alone_is_the_sign_with_the_tie_rule(step: int, tie_break: str) -> None:
    update = pre_sign_update(step)
    expected = brute_force_vote_1bit([update.clone()], step, tie_break)
    vote = OneBitVote(alone())
    bucket = Bucket(update, PIECES, [])
    result = vote.finish(vote.start(bucket, positive_ties=tie_value(step, tie_break) > 0), out=update)
    assert result.data_ptr() == update.data_ptr()  # written over the values it was packed from
    assert torch.equal(result, expected)


@pytest.mark.parametrize("quantizer", ["sign", "l1"])
@pytest.mark.parametrize("aggregation", ["vote", "mean"])
@pytest.mark.parametrize("algorithm", ["allreduce", "alltoall"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kbit_alone_matches_the_brute_force_oracle(quantizer: str, aggregation: str, algorithm: str, bits: int) -> None:
    step = 2
    update = pre_sign_update(bits)
    options = {
        "compression": "kbit",
        "bits": bits,
        "quantizer": quantizer,
        "aggregation": aggregation,
        "kbit_algorithm": algorithm,
    }
    expected = brute_force_vote_kbit(
        [update.clone()], step, bits, quantizer, aggregation, algorithm, segment_sizes=PIECES
    )
    kbit = build_aggregation(parse_config(options), alone(), False)
    assert isinstance(kbit, KbitVote)
    mean_abs: list[torch.Tensor | None] = [None] * len(PIECES) if quantizer == "l1" else []
    result = kbit.finish(kbit.start(Bucket(update, PIECES, mean_abs), tie_value(step, "alternate") > 0), out=update)
    assert torch.equal(result, expected)


def test_l1_piece_cut_from_a_larger_tensor_uses_the_whole_tensors_mean() -> None:
    update = pre_sign_update(5)
    whole_mean = torch.tensor(3.0)  # as if the first piece were a slice of a tensor with a larger mean |c|
    kbit = build_aggregation(
        parse_config({"compression": "kbit", "bits": 8, "quantizer": "l1", "aggregation": "mean"}), alone(), False
    )
    assert isinstance(kbit, KbitVote)
    levels = kbit.codec.levels
    mean_abs: list[torch.Tensor | None] = [whole_mean, None, None, None]
    result = kbit.finish(kbit.start(Bucket(update.clone(), PIECES, mean_abs), True))
    first, rest = update[: PIECES[0]], update[PIECES[0] :]
    expected_first = l1_quantize(first, levels, 2.0, mean_abs=whole_mean).double() / levels
    expected_rest = brute_force_vote_kbit([rest], 1, 8, "l1", "mean", "allreduce", segment_sizes=PIECES[1:])
    assert torch.equal(result[: PIECES[0]], expected_first.float())
    assert torch.equal(result[PIECES[0] :], expected_rest)


def test_buckets_started_together_finish_independently_in_any_order() -> None:
    vote = OneBitVote(alone())
    first, second = pre_sign_update(11), pre_sign_update(12)
    expected_first = brute_force_vote_1bit([first.clone()], 1, "positive")
    expected_second = brute_force_vote_1bit([second.clone()], 1, "positive")
    pending_first = vote.start(Bucket(first, PIECES, []), True)
    pending_second = vote.start(Bucket(second, PIECES, []), True)
    assert torch.equal(vote.finish(pending_second, out=second), expected_second)
    assert torch.equal(vote.finish(pending_first, out=first), expected_first)


def test_exact_mean_alone_returns_the_values_in_fp32_rounded_through_the_comm_dtype() -> None:
    values = pre_sign_update(3)
    assert torch.equal(
        ExactMean(alone(), torch.float32).finish(ExactMean(alone()).start(Bucket(values.clone(), PIECES, []))), values
    )
    mean_bf16 = ExactMean(alone(), torch.bfloat16)
    result = mean_bf16.finish(mean_bf16.start(Bucket(values.clone(), PIECES, [])))
    assert result.dtype == torch.float32 and torch.equal(result, values.bfloat16().float())
