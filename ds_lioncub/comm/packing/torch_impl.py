"""The pure torch implementation of the packing operations: the reference, on any device.

Vectorised torch only, so it runs wherever torch does; the compiled kernels and the cupy path are
tested bit for bit against it. It is also what :mod:`ds_lioncub.kernels.compiled` hands the dtypes its kernels do not
read. The composite operations (signs, sums, the vote, L1) are written with ``self.pack_fields`` and
``self.unpack_fields``, so :class:`~.cupy_impl.CupyPacking` changes only those two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_lioncub.comm.packing.layout import MomentumPiece, ParamPiece, packed_length
from ds_lioncub.lion import apply_update, lion_direction, update_momentum


def sign_bits(x: torch.Tensor, zero_is_positive: bool = True) -> torch.Tensor:
    """Boolean tensor: True where ``x`` counts as +1 (x > 0, or x == 0 with ``zero_is_positive``)."""
    if x.dtype == torch.bool:
        return x
    return x >= 0 if zero_is_positive else x > 0


def pad_bytes(packed: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``packed`` followed by zero bytes up to ``nbytes`` (which the caller made >= its length)."""
    if nbytes == packed.numel():
        return packed
    return torch.cat([packed, packed.new_zeros(nbytes - packed.numel())])


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


def _pack(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """The fields of ``flat`` in ``packed_length(numel, bits)`` bytes."""
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat.to(torch.uint8)
    if bits == 8:
        return flat.clone()
    if flat.numel() == 0:  # an empty strided view stays strided after .contiguous(), and cannot be viewed wider
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
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


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 8:
        return packed[:numel].clone()
    if bits == 1:
        # Copy each byte into all eight bytes of an int64, keep bit j in byte j, test for non-zero.
        words = packed.to(torch.int64) * _REPEAT_BYTE
        words.bitwise_and_(_BIT_J_OF_BYTE_J)
        return words.view(torch.uint8).ne(0).view(torch.uint8)[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    fields = (packed.reshape(-1, 1) >> shifts).bitwise_and_(mask)
    return fields.reshape(-1)[:numel]


# Elements the sketch's reference reads per window (bounds its temporaries: fp32 signs, two fp64 rows of this many).
SKETCH_WINDOW = 1 << 20


def fold_pairwise(values: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` (1-d, at least one) as one element: padded with zeros to the next power of two ``2h``,
    then ``v[i] + v[i + h]`` for ``i < h``, halving ``h`` down to 1. A fixed order, which a kernel repeats bit for bit
    (a torch ``sum`` leaves its order to the build and the CPU)."""
    size = 1 << (values.numel() - 1).bit_length()
    folded = torch.cat([values, values.new_zeros(size - values.numel())])
    while folded.numel() > 1:
        half = folded.numel() // 2
        folded = folded[:half] + folded[half:]
    return folded


def at_least(values: torch.Tensor, threshold: int) -> torch.Tensor:
    """``values >= threshold`` as bool, for any integer threshold: a uint8 tensor (one row's fields) would compare
    with the threshold cast to uint8, which wraps one outside 0 .. 255."""
    if values.dtype == torch.uint8 and not 0 <= threshold <= 255:
        return torch.full(values.shape, threshold <= 0, dtype=torch.bool, device=values.device)
    return values >= threshold


class TorchPacking:
    """:class:`~.layout.PackingOps` in vectorised torch."""

    def pack_fields(self, flat: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
        return pad_bytes(_pack(flat, bits), nbytes)

    def unpack_fields(self, packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        return _unpack(packed, bits, numel)

    def pack_signs(self, flat: torch.Tensor, zero_is_positive: bool, bits: int, nbytes: int) -> torch.Tensor:
        return self.pack_fields(sign_bits(flat, zero_is_positive), bits, nbytes)

    def unpack_signs(
        self, packed: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor:
        signs = self.unpack_fields(packed, 1, numel).to(dtype).mul_(2).sub_(1)
        return signs if out is None else out.copy_(signs)

    def sum_fields_per_position(self, rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        # One unpacked row at a time: temporaries stay at the size of one row's fields.
        sums = torch.zeros(numel, dtype=torch.int32, device=rows.device)
        for row in rows:
            sums.add_(self.unpack_fields(row, bits, numel))
        return sums

    def vote_packed_signs(self, rows: torch.Tensor, numel: int, zero_is_positive: bool) -> torch.Tensor:
        p = rows.size(0)
        plus_votes = self.sum_fields_per_position(rows, 1, numel)
        # vote sum S = 2k - p; S > 0 <=> 2k > p, and S == 0 is a tie.
        vote = 2 * plus_votes >= p if zero_is_positive else 2 * plus_votes > p
        return self.pack_fields(vote, 1, packed_length(numel))

    def pack_l1_fields(
        self, flat: torch.Tensor, scales: torch.Tensor, sizes: list[int], levels: int, bits: int, nbytes: int
    ) -> torch.Tensor:
        fields = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
        start = 0
        for size, scale in zip(sizes, scales.tolist(), strict=True):
            segment = flat[start : start + size]
            if scale == 0:
                fields[start : start + size] = levels
            else:
                q = torch.round(segment.float() * torch.tensor(scale, dtype=torch.float32, device=flat.device))
                fields[start : start + size] = q.clamp_(-levels, levels).to(torch.int32).add_(levels).to(torch.uint8)
            start += size
        return self.pack_fields(fields, bits, nbytes)

    def pack_l1_fields_of_means(
        self,
        flat: torch.Tensor,
        means: torch.Tensor,
        sizes: list[int],
        levels: int,
        clip: float,
        bits: int,
        nbytes: int,
    ) -> torch.Tensor:
        # Imported here: comm.quantize imports the comm package, which imports this module.
        from ds_lioncub.comm.quantize import l1_segment_scales

        _, scales = l1_segment_scales(flat, levels, clip, sizes, means)
        return self.pack_l1_fields(flat, scales, sizes, levels, bits, nbytes)

    def vote_field_sums(self, rows: torch.Tensor, bits: int, numel: int, threshold: int) -> torch.Tensor:
        sums = self.unpack_fields(rows[0], bits, numel) if rows.size(0) == 1 else None
        if sums is None:
            sums = self.sum_fields_per_position(rows, bits, numel)
        return self.pack_fields(at_least(sums, threshold), 1, packed_length(numel))

    # The fused step operations, as the composition of Lion's equations and the packing they fuse: the
    # reference the compiled kernels are held to, and what every other implementation runs.

    def lion_direction_pack_signs(
        self, pieces: Sequence[MomentumPiece], zero_is_positive: bool, bits: int, nbytes: int
    ) -> torch.Tensor:
        sizes = [piece.exp_avg.numel() for piece in pieces]
        directions = torch.empty(sum(sizes), dtype=torch.float32, device=pieces[0].exp_avg.device)
        for piece, direction in zip(pieces, directions.split(sizes), strict=True):
            lion_direction(piece.exp_avg, piece.grad, piece.beta1, out=direction)
            update_momentum(piece.exp_avg, piece.grad, piece.beta2)
        return self.pack_signs(directions, zero_is_positive, bits, nbytes)

    def apply_packed_signs(self, packed: torch.Tensor, pieces: Sequence[ParamPiece]) -> None:
        sizes = [piece.param.numel() for piece in pieces]
        signs = self.unpack_signs(packed, sum(sizes), torch.float32, None)
        for piece, delta in zip(pieces, signs.split(sizes), strict=True):
            apply_update(piece.param, delta, piece.lr, piece.weight_decay)

    def sketch_and_squares(
        self,
        pieces: Sequence[torch.Tensor],
        columns: Sequence[int],
        starts: Sequence[int],
        signs: torch.Tensor,
        period: int,
        out: torch.Tensor,
    ) -> None:
        bins = out.numel() - 1
        # Row 0: the sketch's bins, row 1: the squares' bins. Each row segment of a piece is added with one
        # elementwise add, segment after segment, so every bin sums its elements one after another in order.
        work = torch.stack([out[:bins], torch.zeros_like(out[:bins])])
        for piece, column, start in zip(pieces, columns, starts, strict=True):
            flat = piece.detach().reshape(-1)
            done = 0
            while done < flat.numel():
                position = (start + done) % period
                length = min(flat.numel() - done, period - position, SKETCH_WINDOW)  # never across the period's end
                values = flat[done : done + length].float()
                bit = position % 8
                window = signs[position // 8 : (position + length + 7) // 8]
                products = values * self.unpack_signs(window, bit + length, torch.float32, None)[bit:]
                both = torch.stack([products.double(), values.double().square()])
                bin_, at = (column + done) % bins, 0
                while at < length:
                    segment = min(bins - bin_, length - at)
                    work[:, bin_ : bin_ + segment] += both[:, at : at + segment]
                    at += segment
                    bin_ = 0
                done += length
        out[:bins].copy_(work[0])
        out[bins:] += fold_pairwise(work[1])


__all__ = ["SKETCH_WINDOW", "TorchPacking", "at_least", "fold_pairwise", "pad_bytes", "sign_bits"]
