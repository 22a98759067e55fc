"""Bit packing (ds_lioncub.comm.packing) against plain Python loops over the documented layout.

The layout every packing path and both transports share: signs, element 8*i + j is bit j of byte i (LSB
first), 1 means +1, padding bits 0; b-bit fields, element (8//b)*i + j occupies bits [j*b, (j+1)*b) of byte i.
"""

from __future__ import annotations

import pytest
import torch

from ds_lioncub.comm.packing import (
    count_set_bits_per_position,
    pack_fields,
    pack_signs,
    set_packing_path,
    unpack_fields,
    unpack_signs,
)

SIZES = (0, 1, 7, 8, 9, 63, 64, 65, 1000)
WIDTHS = (1, 2, 4, 8)


# ------------------------------------------------------------------ references: plain loops


def loop_pack_signs(values: list[float], zero_is_positive: bool) -> list[int]:
    out = [0] * ((len(values) + 7) // 8)
    for i, v in enumerate(values):
        bit = 1 if v > 0 or (v == 0 and zero_is_positive) else 0
        out[i // 8] |= bit << (i % 8)
    return out


def loop_unpack_signs(packed: list[int], numel: int) -> list[int]:
    return [1 if (packed[i // 8] >> (i % 8)) & 1 else -1 for i in range(numel)]


def loop_pack_fields(values: list[int], bits: int) -> list[int]:
    per_byte = 8 // bits
    out = [0] * ((len(values) * bits + 7) // 8)
    for i, v in enumerate(values):
        out[i // per_byte] |= v << ((i % per_byte) * bits)
    return out


def loop_unpack_fields(packed: list[int], bits: int, numel: int) -> list[int]:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    return [(packed[i // per_byte] >> ((i % per_byte) * bits)) & mask for i in range(numel)]


def signed_input(n: int, seed: int) -> torch.Tensor:
    """Random values with about a third exact zeros (and a -0.0), so the zero rule matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.33] = 0.0
    if n > 2:
        x[2] = -0.0
    return x


def random_fields(n: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


# ------------------------------------------------------------------ signs


@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_pack_signs_matches_loop(n: int, zero_is_positive: bool) -> None:
    x = signed_input(n, seed=n)
    packed = pack_signs(x, zero_is_positive=zero_is_positive)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == loop_pack_signs(x.tolist(), zero_is_positive)


def test_pack_signs_hand_worked() -> None:
    # elements 0..8: bits LSB first; byte 0 = 0b1000_0101 (elements 0, 2, 7 positive), byte 1 = element 8.
    x = torch.tensor([1.0, -1.0, 0.0, -2.0, -3.0, -0.5, -1.0, 4.0, 5.0])
    assert pack_signs(x, zero_is_positive=True).tolist() == [0b1000_0101, 0b1]
    assert pack_signs(x, zero_is_positive=False).tolist() == [0b1000_0001, 0b1]


def test_pack_signs_negative_zero_follows_the_zero_rule() -> None:
    x = torch.tensor([-0.0, 0.0])
    assert pack_signs(x, zero_is_positive=True).tolist() == [0b11]
    assert pack_signs(x, zero_is_positive=False).tolist() == [0b00]


@pytest.mark.parametrize("n", SIZES)
def test_pack_signs_bool_input(n: int) -> None:
    x = signed_input(n, seed=100 + n) > 0
    expected = loop_pack_signs([1.0 if b else -1.0 for b in x.tolist()], zero_is_positive=False)
    assert pack_signs(x).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_unpack_signs_matches_loop(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7 + n)
    packed = torch.randint(0, 256, ((n + 7) // 8,), generator=g, dtype=torch.int64).to(torch.uint8)
    out = unpack_signs(packed, n, dtype)
    assert out.dtype == dtype
    assert out.shape == (n,)
    assert out.float().tolist() == [float(v) for v in loop_unpack_signs(packed.tolist(), n)]


@pytest.mark.parametrize("path", [pytest.param("compiled", marks=pytest.mark.compiled), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_signs_into_out_overwrites_the_packed_tensor(
    path: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    if path == "compiled":
        request.getfixturevalue("cpu_op")  # the session's build, or its error
    n = 1001
    x = signed_input(n, seed=11).to(dtype)
    expected = [float(v) for v in loop_unpack_signs(loop_pack_signs(x.float().tolist(), True), n)]
    set_packing_path(path)
    try:
        written = unpack_signs(pack_signs(x, True), n, out=x)  # the optimizer's in-place use
        with pytest.raises(ValueError, match="contiguous tensor of 1001 elements"):
            unpack_signs(pack_signs(x, True), n, out=torch.empty(n + 1, dtype=dtype))
    finally:
        set_packing_path(None)
    assert written is x and x.dtype == dtype
    assert x.float().tolist() == expected


@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_sign_round_trip(n: int, zero_is_positive: bool) -> None:
    x = signed_input(n, seed=200 + n)
    tie = 1.0 if zero_is_positive else -1.0
    expected = torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, tie))
    assert torch.equal(unpack_signs(pack_signs(x, zero_is_positive), n, torch.float32), expected)


# ------------------------------------------------------------------ b-bit fields


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_fields_matches_loop(n: int, bits: int) -> None:
    values = random_fields(n, bits, seed=n * 10 + bits)
    packed = pack_fields(values, bits)
    assert packed.dtype == torch.uint8
    assert len(packed) == (n * bits + 7) // 8
    assert packed.tolist() == loop_pack_fields(values.tolist(), bits)


def test_pack_fields_hand_worked() -> None:
    # 2-bit: [1, 2, 3, 0, 3] -> byte 0 = 0b00_11_10_01, byte 1 = 0b11 (padding fields are 0)
    assert pack_fields(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [0b0011_1001, 0b11]
    # 4-bit: [0xA, 0x5, 0xF] -> 0x5A, 0x0F
    assert pack_fields(torch.tensor([10, 5, 15], dtype=torch.uint8), 4).tolist() == [0x5A, 0x0F]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", SIZES)
def test_unpack_fields_matches_loop(n: int, bits: int) -> None:
    g = torch.Generator().manual_seed(300 + n * 10 + bits)
    packed = torch.randint(0, 256, ((n * bits + 7) // 8,), generator=g, dtype=torch.int64).to(torch.uint8)
    out = unpack_fields(packed, bits, n)
    assert out.dtype == torch.uint8
    assert out.tolist() == loop_unpack_fields(packed.tolist(), bits, n)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", SIZES)
def test_field_round_trip(n: int, bits: int) -> None:
    values = random_fields(n, bits, seed=400 + n * 10 + bits)
    assert torch.equal(unpack_fields(pack_fields(values, bits), bits, n), values)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpack_fields_prefix_of_longer_message(bits: int) -> None:
    # Reading fewer fields than the buffer holds returns exactly the leading ones.
    values = random_fields(64, bits, seed=bits)
    assert unpack_fields(pack_fields(values, bits), bits, 13).tolist() == values[:13].tolist()


@pytest.mark.parametrize("start", [1, 3, 8])
@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_fields_of_a_slice(bits: int, start: int) -> None:
    # A view into a larger buffer (storage offset not a multiple of 8, length a multiple of 8) is
    # an ordinary uint8 tensor; packing must not depend on where its storage starts.
    buffer = random_fields(200, bits, seed=500 + bits)
    view = buffer[start : start + 64]
    assert pack_fields(view, bits).tolist() == loop_pack_fields(view.tolist(), bits)


@pytest.mark.parametrize("start", [1, 3, 8])
def test_pack_signs_of_a_bool_slice(start: int) -> None:
    bools = signed_input(200, seed=600) > 0
    view = bools[start : start + 64]
    expected = loop_pack_signs([1.0 if b else -1.0 for b in view.tolist()], zero_is_positive=False)
    assert pack_signs(view).tolist() == expected


@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_fields_of_a_strided_view(bits: int) -> None:
    buffer = random_fields(200, bits, seed=700 + bits)
    view = buffer[::3]
    assert pack_fields(view, bits).tolist() == loop_pack_fields(view.tolist(), bits)


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_bad_field_width_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match=str(bits)):
        pack_fields(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match=str(bits)):
        unpack_fields(torch.zeros(8, dtype=torch.uint8), bits, 8)


# ------------------------------------------------------------------ vote counting


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 65, 1000])
def test_count_set_bits_per_position_matches_loop(p: int, n: int) -> None:
    g = torch.Generator().manual_seed(p * 1000 + n)
    rows = torch.randint(0, 256, (p, (n + 7) // 8), generator=g, dtype=torch.int64).to(torch.uint8)
    expected = [sum((int(rows[r, i // 8]) >> (i % 8)) & 1 for r in range(p)) for i in range(n)]
    counts = count_set_bits_per_position(rows, n)
    assert counts.tolist() == expected
    assert not counts.dtype.is_floating_point
