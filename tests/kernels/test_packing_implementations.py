"""Every packing implementation this process can run, against plain-Python references of the layouts.

Layouts (ds_lioncub/comm/packing/layout.py): field ``i`` of a ``b``-bit message occupies bits
``[i*b, (i+1)*b)`` of the byte stream, least significant bit of byte 0 first; a sign is a field that is
1 for +1 and 0 for -1; bits and bytes past the last field are 0.

The references below walk the message one bit at a time and share no code with the library. Each test
runs once per implementation, forced with ``set_packing_path``: pure torch always; the compiled op when
it builds (the CPU op here; the CUDA op and cupy on a machine with a CUDA device), so both the public
functions' argument handling and the implementation's kernels are under test.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from ds_lioncub.comm import packing
from tests.support.implementations import Implementation

SIZES = (0, 1, 3, 7, 8, 9, 13, 31, 33, 64, 65, 127, 1000, 4099)
WIDTHS = (1, 2, 4, 8)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (width, dtype) of the values pack_fields takes: bool values are 1-bit fields
FIELD_INPUTS = [(bits, dtype) for bits in WIDTHS for dtype in (torch.uint8, torch.int32)] + [(1, torch.bool)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# More elements than one parallel task of the CPU kernels takes (128K signs, or fewer votes per task)
LARGE = (1 << 18) + 13


# ====================================================================== references: one bit at a time


def ref_pack(fields: list[int], bits: int, nbytes: int | None = None) -> list[int]:
    """The message holding ``fields``, ``bits`` bits each, padded with zero bytes to ``nbytes``."""
    length = (len(fields) * bits + 7) // 8 if nbytes is None else nbytes
    message = [0] * length
    for i, field in enumerate(fields):
        for k in range(bits):
            if (field >> k) & 1:
                position = i * bits + k
                message[position // 8] |= 1 << (position % 8)
    return message


def ref_unpack(message: list[int], bits: int, numel: int) -> list[int]:
    """The first ``numel`` ``bits``-wide fields of ``message``."""
    fields = []
    for i in range(numel):
        field = 0
        for k in range(bits):
            position = i * bits + k
            field |= ((message[position // 8] >> (position % 8)) & 1) << k
        fields.append(field)
    return fields


def ref_sign(value: float, zero_is_positive: bool) -> int:
    """1 (+1) for a positive value, and for a zero of either sign when ``zero_is_positive``; else 0.

    NaN is neither positive nor zero: it counts as -1.
    """
    return 1 if value > 0 or (value == 0 and zero_is_positive) else 0


def ref_vote(rows: list[list[int]], numel: int, zero_is_positive: bool) -> list[int]:
    """The packed majority of the sign messages ``rows``: +1 votes against -1 votes, position by position."""
    votes = []
    for i in range(numel):
        plus = 0
        for row in rows:
            plus += (row[i // 8] >> (i % 8)) & 1
        minus = len(rows) - plus
        votes.append(1 if plus > minus or (plus == minus and zero_is_positive) else 0)
    return ref_pack(votes, 1)


def to_fp32(value: float) -> float:
    """``value`` rounded to the nearest float32, ties to even (what an fp32 multiply does to its exact product)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # finite, but beyond the largest float32
        return math.copysign(math.inf, value)


def ref_l1_fields(values: list[float], scales: list[float], sizes: list[int], levels: int) -> list[int]:
    """Fields ``q + L``, ``q = clamp(round_half_even(fp32(c * s)), -L, L)``; a zero scale gives q = 0."""
    fields = []
    start = 0
    for size, scale in zip(sizes, scales, strict=True):
        for value in values[start : start + size]:
            if scale == 0:
                q = 0
            else:
                # value and scale have at most 24 significant bits: their product is exact in a double.
                # Clamping before rounding gives the same q (the bounds are integers) and keeps inf out of round().
                q = round(min(max(to_fp32(value * scale), -levels), levels))
            fields.append(q + levels)
        start += size
    return fields


# ====================================================================== inputs


def signed_values(n: int, seed: int) -> torch.Tensor:
    """Random float32 values with exact zeros of both signs, NaNs, infinities and subnormals among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.25] = 0.0
    specials = [-0.0, 0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, -float("nan")]
    for i, value in enumerate(specials[: n // 2]):
        x[2 * i + 1] = value
    return x


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


def random_fields(n: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64)


# ====================================================================== the implementations


# ====================================================================== b-bit fields


@pytest.mark.parametrize(
    ("bits", "dtype"), FIELD_INPUTS, ids=[f"{bits}bit-{dtype_name(dtype)}" for bits, dtype in FIELD_INPUTS]
)
def test_pack_fields_puts_field_i_at_bits_i_times_b_least_significant_first(
    impl: Implementation, bits: int, dtype: torch.dtype
) -> None:
    for n in SIZES:
        values = random_fields(n, bits, seed=10 * n + bits).to(dtype)
        packed = packing.pack_fields(impl.put(values), bits)
        assert packed.dtype == torch.uint8 and packed.device.type == impl.device
        assert packed.cpu().tolist() == ref_pack([int(v) for v in values.tolist()], bits), n


@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_fields_pads_the_message_with_zero_bytes_up_to_nbytes(impl: Implementation, bits: int) -> None:
    for n in (0, 1, 9, 65, 1000):
        values = random_fields(n, bits, seed=n + bits).to(torch.uint8)
        nbytes = (n * bits + 7) // 8 + 5
        packed = packing.pack_fields(impl.put(values), bits, nbytes=nbytes)
        assert packed.cpu().tolist() == ref_pack(values.tolist(), bits, nbytes), n


@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_fields_reads_views_in_element_order(impl: Implementation, bits: int) -> None:
    buffer = impl.put(random_fields(400, bits, seed=bits).to(torch.uint8))
    for view in (buffer[1:66], buffer[3:102], buffer[::3], buffer[:256].view(16, 16).t()):
        expected = ref_pack(view.reshape(-1).cpu().tolist(), bits)
        assert packing.pack_fields(view, bits).cpu().tolist() == expected


@pytest.mark.parametrize("bits", WIDTHS)
def test_an_empty_strided_view_packs_to_an_empty_message(impl: Implementation, bits: int) -> None:
    for dtype in (torch.bool, torch.uint8, torch.float32):
        empty_view = impl.put(torch.ones(9, dtype=dtype))[4:4:2]
        assert packing.pack_fields(empty_view, bits).cpu().tolist() == []
        assert packing.pack_signs(empty_view, bits=bits).cpu().tolist() == []
        assert packing.pack_signs(empty_view, bits=bits, nbytes=2).cpu().tolist() == [0, 0]


@pytest.mark.parametrize("bits", WIDTHS)
def test_unpack_fields_reads_the_first_numel_fields_and_ignores_the_bytes_after(
    impl: Implementation, bits: int
) -> None:
    for n in SIZES:
        message = random_bytes((n * bits + 7) // 8 + 3, seed=100 * n + bits)
        fields = packing.unpack_fields(impl.put(message), bits, n)
        assert fields.dtype == torch.uint8
        assert fields.cpu().tolist() == ref_unpack(message.tolist(), bits, n), n


@pytest.mark.parametrize("bits", WIDTHS)
def test_unpack_fields_of_a_message_with_no_spare_byte(impl: Implementation, bits: int) -> None:
    for n in SIZES:
        message = random_bytes((n * bits + 7) // 8, seed=n + 7 * bits)
        assert packing.unpack_fields(impl.put(message), bits, n).cpu().tolist() == ref_unpack(message.tolist(), bits, n)


@pytest.mark.parametrize("bits", WIDTHS)
def test_sum_fields_per_position_adds_the_fields_of_every_row(impl: Implementation, bits: int) -> None:
    for p in (1, 2, 3, 5, 17):
        for n in (1, 7, 9, 33, 1000):
            row_bytes = (n * bits + 7) // 8 + 2  # bytes past the fields must not count
            rows = random_bytes(p * row_bytes, seed=1000 * p + 10 * n + bits).view(p, row_bytes)
            unpacked = [ref_unpack(row, bits, n) for row in rows.tolist()]
            expected = [sum(column) for column in zip(*unpacked, strict=True)]
            sums = packing.sum_fields_per_position(impl.put(rows), bits, n)
            assert sums.dtype == torch.int32
            assert sums.cpu().tolist() == expected, (p, n)
            strided = packing.sum_fields_per_position(impl.put(rows)[:, 1:], bits, n)  # rows not contiguous
            unpacked = [ref_unpack(row[1:], bits, n) for row in rows.tolist()]
            expected = [sum(column) for column in zip(*unpacked, strict=True)]
            assert strided.cpu().tolist() == expected, (p, n)


def test_count_set_bits_per_position_counts_the_plus_votes(impl: Implementation) -> None:
    for p in (1, 2, 5):
        for n in (1, 8, 65, 1000):
            rows = random_bytes(p * ((n + 7) // 8), seed=p * 31 + n).view(p, -1)
            expected = [sum((row[i // 8] >> (i % 8)) & 1 for row in rows.tolist()) for i in range(n)]
            assert packing.count_set_bits_per_position(impl.put(rows), n).cpu().tolist() == expected


# ====================================================================== signs


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_pack_signs_is_1_for_positive_values_and_for_zeros_when_zero_is_positive(
    impl: Implementation, dtype: torch.dtype, zero_is_positive: bool, bits: int
) -> None:
    for n in SIZES:
        x = signed_values(n, seed=n).to(dtype)
        expected = ref_pack([ref_sign(v, zero_is_positive) for v in x.tolist()], bits)
        packed = packing.pack_signs(impl.put(x), zero_is_positive, bits=bits)
        assert packed.cpu().tolist() == expected, n
    assert x.eq(0).any(), "the input must contain zeros, or the zero rule goes untested"


@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_signs_of_bool_input_is_1_where_true(impl: Implementation, bits: int) -> None:
    for n in SIZES:
        x = signed_values(n, seed=n + 1) > 0
        packed = packing.pack_signs(impl.put(x), bits=bits)
        assert packed.cpu().tolist() == ref_pack([int(v) for v in x.tolist()], bits), n


def test_pack_signs_counts_nan_as_minus_one_and_keeps_the_sign_of_subnormals(impl: Implementation) -> None:
    x = torch.tensor([float("nan"), -float("nan"), 1e-40, -1e-40, float("inf"), float("-inf"), 0.0, -0.0])
    for zero_is_positive, expected in ((True, 0b1101_0100), (False, 0b0001_0100)):
        assert packing.pack_signs(impl.put(x), zero_is_positive).cpu().tolist() == [expected]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,), ids=dtype_name)
def test_pack_signs_pads_the_message_with_zero_bytes_up_to_nbytes(
    impl: Implementation, dtype: torch.dtype, bits: int
) -> None:
    for n in (0, 1, 13, 1000):
        x = signed_values(n, seed=n).to(dtype)
        nbytes = (n * bits + 7) // 8 + 3
        expected = ref_pack([ref_sign(v, True) for v in x.tolist()], bits, nbytes)
        assert packing.pack_signs(impl.put(x), True, bits=bits, nbytes=nbytes).cpu().tolist() == expected


def test_pack_signs_reads_views_in_element_order(impl: Implementation) -> None:
    x = impl.put(signed_values(3000, seed=5))
    for view in (x[3:1003], x[::3][:999], x[:3000].view(50, 60).t()):
        expected = ref_pack([ref_sign(v, False) for v in view.reshape(-1).cpu().tolist()], 1)
        assert packing.pack_signs(view, False).cpu().tolist() == expected


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64, torch.int8), ids=dtype_name)
def test_unpack_signs_gives_plus_one_for_a_set_bit_and_minus_one_for_a_clear_bit(
    impl: Implementation, dtype: torch.dtype
) -> None:
    for n in SIZES:
        message = random_bytes((n + 7) // 8 + 2, seed=n)
        signs = packing.unpack_signs(impl.put(message), n, dtype)
        assert signs.dtype == dtype and signs.shape == (n,)
        assert signs.cpu().tolist() == [1 if bit else -1 for bit in ref_unpack(message.tolist(), 1, n)], n


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float64,), ids=dtype_name)
def test_unpack_signs_into_out_overwrites_the_tensor_whose_signs_were_packed(
    impl: Implementation, dtype: torch.dtype
) -> None:
    x = impl.put(signed_values(1001, seed=3).nan_to_num(0.0).to(dtype).view(7, 143))
    expected = [1 if ref_sign(v, False) else -1 for v in x.reshape(-1).cpu().tolist()]
    written = packing.unpack_signs(packing.pack_signs(x, False), x.numel(), out=x)
    assert written is x and x.dtype == dtype and x.shape == (7, 143)
    assert x.reshape(-1).cpu().tolist() == expected


@pytest.mark.parametrize("zero_is_positive", [True, False])
def test_sign_bits_is_true_for_positive_values_and_for_zeros_when_zero_is_positive(
    impl: Implementation, zero_is_positive: bool
) -> None:
    x = signed_values(200, seed=9)
    expected = [bool(ref_sign(v, zero_is_positive)) for v in x.tolist()]
    assert packing.sign_bits(impl.put(x), zero_is_positive).cpu().tolist() == expected


# ====================================================================== the 1-bit vote


@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 33])
def test_vote_packed_signs_is_the_majority_with_ties_by_zero_is_positive(
    impl: Implementation, p: int, zero_is_positive: bool
) -> None:
    ties = 0
    for n in (1, 7, 8, 9, 63, 65, 1000):
        row_bytes = (n + 7) // 8 + 1  # the bits past numel are noise and must not vote
        rows = random_bytes(p * row_bytes, seed=100 * p + n).view(p, row_bytes)
        vote = packing.vote_packed_signs(impl.put(rows), n, zero_is_positive)
        assert vote.dtype == torch.uint8
        assert vote.cpu().tolist() == ref_vote(rows.tolist(), n, zero_is_positive), n
        strided = packing.vote_packed_signs(impl.put(rows)[:, 1:], n, zero_is_positive)  # rows not contiguous
        assert strided.cpu().tolist() == ref_vote([row[1:] for row in rows.tolist()], n, zero_is_positive), n
        counts = [sum((row[i // 8] >> (i % 8)) & 1 for row in rows.tolist()) for i in range(n)]
        ties += sum(2 * count == p for count in counts)
    assert ties > 0 or p % 2 == 1, "an even number of voters must meet ties here, or the tie rule goes untested"


def test_vote_packed_signs_hand_worked_ties(impl: Implementation) -> None:
    # p = 4: rows 0b1111_0000 (x2) and 0b1100_1100 (x2): plus votes 2 (tie) / 4 / 0 per position.
    rows = impl.put(torch.tensor([[0xF0], [0xF0], [0xCC], [0xCC]], dtype=torch.uint8))
    assert packing.vote_packed_signs(rows, 8, True).cpu().tolist() == [0b1111_1100]
    assert packing.vote_packed_signs(rows, 8, False).cpu().tolist() == [0b1100_0000]


# ====================================================================== the L1 quantizer


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_l1_fields_rounds_c_times_scale_half_to_even_and_clamps_to_the_levels(
    impl: Implementation, bits: int, dtype: torch.dtype
) -> None:
    top = ((1 << bits) - 1) // 2
    for levels in sorted({1, max(1, top // 2), top}):
        # c * 0.25 lands exactly on k + 1/2 for these: round half to even decides
        halves = 4 * (torch.arange(-levels - 2, levels + 2, dtype=torch.float32) + 0.5)
        for n in (1, 9, 100, 1001):
            c = torch.cat([halves, signed_values(n, seed=n + levels).nan_to_num(0.0, math.inf, -math.inf) * 3])
            c = c.to(dtype)
            third = c.numel() // 3
            sizes = [third, 0, third, c.numel() - 2 * third]
            scales = torch.tensor([0.25, 1.5, 0.0, 1.7], dtype=torch.float32)  # a zero scale: every q is 0
            expected = ref_pack(ref_l1_fields(c.tolist(), scales.tolist(), sizes, levels), bits)
            packed = packing.pack_l1_fields(impl.put(c), scales, sizes, levels, bits)
            assert packed.cpu().tolist() == expected, (levels, n)
            nbytes = len(expected) + 3
            padded = packing.pack_l1_fields(impl.put(c), scales.tolist(), sizes, levels, bits, nbytes=nbytes)
            assert padded.cpu().tolist() == expected + [0, 0, 0], (levels, n)


def test_pack_l1_fields_hand_worked(impl: Implementation) -> None:
    # scale 1, L = 7, 4-bit fields q + 7: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2, 0.49 -> 0,
    # 7.5 -> 8 clamped to 7, -9 clamped to -7; fields 7 9 9 7 5 7 14 0, two per byte, the first one low.
    c = impl.put(torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 0.49, 7.5, -9.0]))
    assert packing.pack_l1_fields(c, [1.0], [8], 7, 4).cpu().tolist() == [0x97, 0x79, 0x75, 0x0E]


# ====================================================================== large messages


def test_large_messages_match_the_references(impl: Implementation) -> None:
    x = signed_values(LARGE, seed=1)
    signs = [ref_sign(v, True) for v in x.tolist()]
    packed = packing.pack_signs(impl.put(x), True)
    assert packed.cpu().tolist() == ref_pack(signs, 1)
    unpacked = packing.unpack_signs(packed, LARGE, torch.bfloat16).cpu()
    assert unpacked.tolist() == [1.0 if s else -1.0 for s in signs]
    rows = random_bytes(3 * ((LARGE + 7) // 8), seed=2).view(3, -1)
    vote = packing.vote_packed_signs(impl.put(rows), LARGE, False)
    assert vote.cpu().tolist() == ref_vote(rows.tolist(), LARGE, False)


# ====================================================================== arguments every implementation rejects


def test_every_implementation_rejects_an_nbytes_shorter_than_the_message(impl: Implementation) -> None:
    with pytest.raises(ValueError, match="smaller"):
        packing.pack_signs(impl.put(torch.ones(17)), nbytes=2)
    with pytest.raises(ValueError, match="smaller"):
        packing.pack_fields(impl.put(torch.ones(9, dtype=torch.uint8)), 2, nbytes=2)
    with pytest.raises(ValueError, match="smaller"):
        packing.pack_l1_fields(impl.put(torch.ones(9)), [1.0], [9], 1, 2, nbytes=2)


def test_every_implementation_rejects_a_message_too_short_for_numel(impl: Implementation) -> None:
    with pytest.raises(ValueError, match="hold fewer than 5 4-bit fields"):
        packing.unpack_fields(impl.put(random_bytes(2, seed=0)), 4, 5)
    with pytest.raises(ValueError, match="hold fewer than 17 signs"):
        packing.unpack_signs(impl.put(random_bytes(2, seed=0)), 17)
    with pytest.raises(ValueError, match="hold fewer than 17 signs"):
        packing.vote_packed_signs(impl.put(random_bytes(4, seed=0)).view(2, 2), 17)
    with pytest.raises(ValueError, match="hold fewer than 9 2-bit fields"):
        packing.sum_fields_per_position(impl.put(random_bytes(4, seed=0)).view(2, 2), 2, 9)


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_every_implementation_rejects_a_field_width_other_than_1_2_4_8(impl: Implementation, bits: int) -> None:
    with pytest.raises(ValueError, match=str(bits)):
        packing.pack_fields(impl.put(torch.zeros(8, dtype=torch.uint8)), bits)
    with pytest.raises(ValueError, match=str(bits)):
        packing.unpack_fields(impl.put(torch.zeros(8, dtype=torch.uint8)), bits, 8)
    with pytest.raises(ValueError, match=str(bits)):
        packing.pack_signs(impl.put(torch.ones(8)), bits=bits)


def test_every_implementation_rejects_a_vote_without_a_p_by_nbytes_stack(impl: Implementation) -> None:
    with pytest.raises(ValueError, match="stack"):
        packing.vote_packed_signs(impl.put(random_bytes(4, seed=0)), 8)
    with pytest.raises(ValueError, match="at least one row"):
        packing.vote_packed_signs(impl.put(random_bytes(0, seed=0)).view(0, 4), 8)
    with pytest.raises(ValueError, match="stack"):
        packing.sum_fields_per_position(impl.put(random_bytes(4, seed=0)), 1, 8)
