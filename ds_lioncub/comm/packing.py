"""Bit packing for the compressed collectives.

Every compressed message is a flat uint8 tensor. Two layouts are used, both least significant
bit first so that element order equals bit order:

- signs: element ``8*i + j`` is bit ``j`` of byte ``i`` (1 means +1, 0 means -1);
- fields: ``b``-bit unsigned fields, element ``(8//b)*i + j`` in bits ``[j*b, (j+1)*b)`` of byte ``i``.

This module is the single entry point for packing. The functions here are vectorised pure torch;
compiled kernels (the op builder) slot in behind the same signatures.
"""

from __future__ import annotations

import torch

FIELD_WIDTHS = (1, 2, 4, 8)


def packed_length(numel: int, bits: int = 1) -> int:
    """Bytes needed for ``numel`` fields of ``bits`` bits."""
    return (numel * bits + 7) // 8


def _pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    remainder = x.numel() % multiple
    if remainder == 0:
        return x
    return torch.cat([x, x.new_zeros(multiple - remainder)])


# Multiplying eight 0/1 bytes, read as one little-endian int64, by this constant gathers byte j's
# bit into bit 56 + j without carries, so one multiply and one shift pack eight signs.
_GATHER_EIGHT_BITS = 0x0102040810204080
_REPEAT_BYTE = 0x0101010101010101
_BIT_J_OF_BYTE_J = 0x8040201008040201 - (1 << 64)  # as a signed int64


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-wide fields (entries must be < 2**bits) into uint8."""
    if bits not in FIELD_WIDTHS:
        raise ValueError(f"field width must be one of {FIELD_WIDTHS}, got {bits}")
    flat = values.reshape(-1)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat.to(torch.uint8)
    if bits == 8:
        return flat.clone()
    # Read each byte group as one wider integer and move its fields together with shifts.
    grouped = _pad_to_multiple(flat, 8 // bits).contiguous()
    if grouped.storage_offset() % (8 // bits) != 0:
        grouped = grouped.clone()  # a wide-integer view needs an aligned start
    if bits == 1:
        words = grouped.view(torch.int64)
        return ((words * _GATHER_EIGHT_BITS) >> 56).to(torch.uint8)
    if bits == 2:
        words = grouped.view(torch.int32)
        return (words | (words >> 6) | (words >> 12) | (words >> 18)).to(torch.uint8)
    words = grouped.view(torch.int16)
    return (words | (words >> 4)).to(torch.uint8)


def unpack_fields(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: uint8 tensor of the first ``numel`` fields."""
    if bits not in FIELD_WIDTHS:
        raise ValueError(f"field width must be one of {FIELD_WIDTHS}, got {bits}")
    if bits == 8:
        return packed[:numel].clone()
    if bits == 1:
        # Copy each byte into all eight bytes of an int64, keep bit j in byte j, test for non-zero.
        words = packed.to(torch.int64) * _REPEAT_BYTE
        words.bitwise_and_(_BIT_J_OF_BYTE_J)
        return words.view(torch.uint8).ne(0).view(torch.uint8)[:numel]
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    fields = (packed.reshape(-1, 1) >> shifts).bitwise_and_(mask)
    return fields.reshape(-1)[:numel]


def sign_bits(x: torch.Tensor, zero_is_positive: bool = True) -> torch.Tensor:
    """Boolean tensor: True where ``x`` counts as +1 (x > 0, or x == 0 with ``zero_is_positive``)."""
    if x.dtype == torch.bool:
        return x
    return x >= 0 if zero_is_positive else x > 0


def pack_signs(x: torch.Tensor, zero_is_positive: bool = True) -> torch.Tensor:
    """Pack the signs of a flat tensor into ``ceil(n/8)`` bytes; zeros follow ``zero_is_positive``."""
    return pack_fields(sign_bits(x.reshape(-1), zero_is_positive), 1)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack the first ``numel`` sign bits to +1/-1 in ``dtype``."""
    bits = unpack_fields(packed, 1, numel)
    return bits.to(dtype).mul_(2).sub_(1)


def count_set_bits_per_position(packed_rows: torch.Tensor, numel: int) -> torch.Tensor:
    """For a ``(p, nbytes)`` stack of packed sign messages, the number of +1 votes at each position.

    This is the server half of the 1-bit vote: the returned int32 counts ``k`` give the vote sum
    ``2*k - p``. Temporaries are one unpacked row at a time, so memory stays at the chunk size.
    """
    counts = torch.zeros(numel, dtype=torch.int32, device=packed_rows.device)
    for row in packed_rows:
        counts.add_(unpack_fields(row, 1, numel))
    return counts
