"""The message layouts and the operations every packing implementation provides.

Every compressed message is a flat uint8 tensor. Two layouts are used, both least significant bit
first so that element order equals bit order:

- signs: element ``8*i + j`` is bit ``j`` of byte ``i`` (1 means +1, 0 means -1);
- fields: ``b``-bit unsigned fields, element ``(8//b)*i + j`` in bits ``[j*b, (j+1)*b)`` of byte ``i``.

Bits and bytes past the last element are 0. :class:`PackingOps` is the contract of an implementation
(``torch_impl``, ``cupy_impl``, ``compiled``): the public functions in ``ds_lioncub.comm.packing``
check their arguments, flatten the tensors and resolve the message length, so an implementation only
computes; every implementation gives the same bytes for the same arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

FIELD_WIDTHS = (1, 2, 4, 8)
L1_FIELD_WIDTHS = (2, 4, 8)  # an L1 field holds q + L for q in [-L, L] with L >= 1: at least 2 bits


def packed_length(numel: int, bits: int = 1) -> int:
    """Bytes needed for ``numel`` fields of ``bits`` bits."""
    return (numel * bits + 7) // 8


class MomentumPiece(NamedTuple):
    """One piece of a bucket for the fused direction pass: a momentum view (updated in place), its
    gradient (flat, the same number of elements) and the piece's Lion betas."""

    exp_avg: torch.Tensor
    grad: torch.Tensor
    beta1: float
    beta2: float


class ParamPiece(NamedTuple):
    """One piece of a bucket for the fused update: a parameter view (updated in place), lr and weight decay."""

    param: torch.Tensor
    lr: float
    weight_decay: float


class PackingOps(Protocol):
    """The packing operations, on arguments the public functions have already checked.

    Tensors named ``flat`` and ``packed`` are 1-d (possibly non-contiguous views); ``rows`` is a
    2-d ``(p, bytes per row)`` stack whose rows hold at least the requested fields. ``nbytes`` is the
    exact length of the returned message, at least :func:`packed_length`; the bytes past the fields
    are 0.
    """

    def pack_fields(self, flat: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
        """``bits``-wide fields (entries < 2**bits; bool or any integer dtype) packed into ``nbytes`` bytes."""
        ...

    def unpack_fields(self, packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        """The first ``numel`` fields as a uint8 tensor."""
        ...

    def pack_signs(self, flat: torch.Tensor, zero_is_positive: bool, bits: int, nbytes: int) -> torch.Tensor:
        """One ``bits``-wide field per element, 1 where it counts as +1 (see ``sign_bits``), else 0."""
        ...

    def unpack_signs(
        self, packed: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The first ``numel`` sign bits as +1/-1: a new 1-d tensor of ``dtype``, or written into ``out``
        (1-d, contiguous, ``numel`` elements, its own dtype) and ``out`` returned."""
        ...

    def sum_fields_per_position(self, rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        """int32 sums over the rows of the first ``numel`` ``bits``-wide fields, position by position."""
        ...

    def vote_packed_signs(self, rows: torch.Tensor, numel: int, zero_is_positive: bool) -> torch.Tensor:
        """Packed majority of at least one row of sign messages over the first ``numel`` positions:
        1 where the plus votes are more than half of the rows, and where they are exactly half if
        ``zero_is_positive``; ``packed_length(numel)`` bytes."""
        ...

    def pack_l1_fields(
        self, flat: torch.Tensor, scales: torch.Tensor, sizes: list[int], levels: int, bits: int, nbytes: int
    ) -> torch.Tensor:
        """Fields ``clamp(round_half_even(c * s), -L, L) + L``: segment ``i`` of ``sizes`` uses the fp32
        scale ``scales[i]`` (a 1-d float32 tensor); a scale of 0 gives q = 0 for its whole segment."""
        ...

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
        """:meth:`pack_l1_fields` with the scales of ``l1_segment_scales(flat, levels, clip, sizes, means)``
        (:mod:`ds_lioncub.comm.quantize`: ``levels / (clip * mu)`` rounded as torch rounds it, 0 where mu is not
        > 0); ``means`` is a 1-d tensor of each segment's mu."""
        ...

    def vote_field_sums(self, rows: torch.Tensor, bits: int, numel: int, threshold: int) -> torch.Tensor:
        """Packed bits (``packed_length(numel)`` bytes) of ``sums >= threshold``, ``sums`` the int32 sums over the
        rows of the first ``numel`` ``bits``-wide fields, position by position (one row: its fields)."""
        ...

    def lion_direction_pack_signs(
        self, pieces: Sequence[MomentumPiece], zero_is_positive: bool, bits: int, nbytes: int
    ) -> torch.Tensor:
        """The sign fields of Lion's fp32 pre-sign update ``c`` of every piece, one piece after the other,
        packed as ``pack_signs`` packs them (``nbytes`` bytes), and each piece's momentum updated in place:
        exactly ``lion_direction`` then ``update_momentum`` (:mod:`ds_lioncub.lion`) then ``pack_signs``."""
        ...

    def apply_packed_signs(self, packed: torch.Tensor, pieces: Sequence[ParamPiece]) -> None:
        """Each piece's parameter updated in place by the next ``numel`` sign bits of ``packed`` (1 = +1):
        exactly ``unpack_signs`` to fp32 then ``apply_update`` (:mod:`ds_lioncub.lion`) per piece."""
        ...

    def sketch_and_squares(
        self,
        pieces: Sequence[torch.Tensor],
        columns: Sequence[int],
        starts: Sequence[int],
        signs: torch.Tensor,
        period: int,
        out: torch.Tensor,
    ) -> None:
        """Option clip's sketch (:mod:`ds_lioncub.step.clipping`), added to ``out`` (fp64, ``K + 1`` elements) in place.

        Element ``i`` of ``pieces[p]`` (floating, any shape, read flat) goes to bin ``(columns[p] + i) mod K`` with the
        sign bit ``(starts[p] + i) mod period`` of ``signs`` (uint8, the sign layout, 1 = +1, holding ``period +
        64`` bits, the last 64 a copy of the first 64). Each bin of ``out[:K]`` adds, in fp64 and one after
        another, the product of its elements' fp32 values and their signs, in element order, the pieces in the
        order given; K more bins add the elements' squares the same way, and ``out[K]`` adds their pairwise fold
        (:func:`~.torch_impl.fold_pairwise`)."""
        ...


__all__ = ["FIELD_WIDTHS", "L1_FIELD_WIDTHS", "MomentumPiece", "PackingOps", "ParamPiece", "packed_length"]
