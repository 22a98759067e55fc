"""KbitCodec: the summed-field arithmetic, checked by enumerating what p ranks can actually send.

For each configuration the test builds every rank's field from its value ``q`` by the definition
(sign: 1 for +1, 0 for -1; L1: ``q + L``), sums the fields and the ``q`` separately, and checks the
codec's decoding, its vote threshold and its no-carry limits against those sums.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ds_lioncub.comm.kbit import KbitCodec, max_allreduce_world_size
from ds_lioncub.errors import LionCubConfigError

CONFIGS = [
    (p, bits, quantizer, algorithm)
    for bits in (2, 4, 8)
    for quantizer in ("sign", "l1")
    for algorithm in ("allreduce", "alltoall")
    for p in (1, 2, 3, 4, 5, 7, 15)
    if algorithm == "alltoall" or p <= max_allreduce_world_size(bits, quantizer)
]


def rank_values(codec: KbitCodec, samples: int = 3000) -> list[tuple[int, ...]]:
    """Every combination of the ranks' q when there are few, else the extremes plus a random sample."""
    values = [-1, 1] if codec.quantizer == "sign" else list(range(-codec.levels, codec.levels + 1))
    if len(values) ** codec.world_size <= samples:
        return list(itertools.product(values, repeat=codec.world_size))
    generator = random.Random(codec.world_size * 1000 + codec.bits)
    extremes = [tuple([v] * codec.world_size) for v in (values[0], values[-1])]
    return extremes + [tuple(generator.choice(values) for _ in range(codec.world_size)) for _ in range(samples)]


def field_of(codec: KbitCodec, q: int) -> int:
    return (1 if q > 0 else 0) if codec.quantizer == "sign" else q + codec.levels


@pytest.mark.parametrize("p,bits,quantizer,algorithm", CONFIGS)
def test_field_sums_decode_to_the_sum_of_the_ranks_values(p: int, bits: int, quantizer: str, algorithm: str) -> None:
    codec = KbitCodec.build(p, bits, quantizer, algorithm)  # type: ignore[arg-type]
    combos = rank_values(codec)
    field_sums = torch.tensor([sum(field_of(codec, q) for q in combo) for combo in combos])
    assert codec.signed_sum(field_sums).tolist() == [sum(combo) for combo in combos]


@pytest.mark.parametrize("p,bits,quantizer,algorithm", CONFIGS)
@pytest.mark.parametrize("positive_ties", [True, False])
def test_vote_threshold_gives_the_sign_of_the_sum_with_the_tie_rule(
    p: int, bits: int, quantizer: str, algorithm: str, positive_ties: bool
) -> None:
    codec = KbitCodec.build(p, bits, quantizer, algorithm)  # type: ignore[arg-type]
    threshold = codec.vote_threshold(positive_ties)
    for combo in rank_values(codec):
        total = sum(combo)
        expected_positive = total > 0 or (total == 0 and positive_ties)
        assert (sum(field_of(codec, q) for q in combo) >= threshold) == expected_positive, combo


@pytest.mark.parametrize("p,bits,quantizer,algorithm", CONFIGS)
def test_summed_fields_fit_their_widths(p: int, bits: int, quantizer: str, algorithm: str) -> None:
    codec = KbitCodec.build(p, bits, quantizer, algorithm)  # type: ignore[arg-type]
    largest_sum = max(sum(field_of(codec, q) for q in combo) for combo in rank_values(codec))
    largest_field = max(field_of(codec, q) for q in (-codec.levels, codec.levels))
    assert largest_field <= (1 << bits) - 1  # one rank's field always fits its b bits
    assert largest_sum <= codec.max_field_sum < (1 << codec.sum_width)
    widths = (1, 2, 4, 8, 16, 32)
    narrower = [w for w in widths if w < codec.sum_width]
    assert codec.sum_width in widths and all(codec.max_field_sum > (1 << w) - 1 for w in narrower)
    if algorithm == "allreduce":  # summed inside one b-bit field: no carry into the neighbour
        assert codec.max_field_sum <= (1 << bits) - 1
    # rank_values always holds the two extremes (every rank at -L, every rank at +L)
    assert codec.mean_divisor == max(abs(sum(combo)) for combo in rank_values(codec))


@pytest.mark.parametrize("quantizer", ["sign", "l1"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_l1_levels_are_the_most_the_fields_allow(bits: int, quantizer: str) -> None:
    top = (1 << bits) - 1
    for p in range(1, max_allreduce_world_size(bits, quantizer) + 1):
        codec = KbitCodec.build(p, bits, quantizer, "allreduce")  # type: ignore[arg-type]
        if quantizer == "l1":
            assert p * 2 * codec.levels <= top < p * 2 * (codec.levels + 1)
        else:
            assert codec.levels == 1
    alltoall = KbitCodec.build(1000, bits, quantizer, "alltoall")  # type: ignore[arg-type]
    assert alltoall.levels == (top // 2 if quantizer == "l1" else 1)


@pytest.mark.parametrize("bits,quantizer", [(2, "sign"), (4, "sign"), (2, "l1"), (4, "l1"), (8, "l1"), (8, "sign")])
def test_a_world_too_large_for_the_allreduce_fields_is_a_config_error_naming_the_fix(bits: int, quantizer: str) -> None:
    largest = max_allreduce_world_size(bits, quantizer)
    # Independently: the largest p whose summed fields fit b bits.
    per_rank = 1 if quantizer == "sign" else 2
    assert largest == max(p for p in range(1, 300) if p * per_rank * 1 <= (1 << bits) - 1)
    with pytest.raises(
        LionCubConfigError, match=rf"^LionCub: .*hold at most {largest} workers.*kbit_algorithm='alltoall'"
    ):
        KbitCodec.build(largest + 1, bits, quantizer, "allreduce")  # type: ignore[arg-type]
    KbitCodec.build(largest + 1, bits, quantizer, "alltoall")  # type: ignore[arg-type]


def test_unknown_width_is_a_config_error() -> None:
    with pytest.raises(LionCubConfigError, match="bits must be one of"):
        KbitCodec.build(2, 3, "sign", "allreduce")
