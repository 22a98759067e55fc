"""The arithmetic of summed b-bit fields: levels, widths, world-size limits, thresholds.

A k-bit message carries one unsigned b-bit field per element. The "sign" quantizer sends
``(q + 1) / 2`` for ``q = ±1``; the L1 quantizer sends ``q + L`` for ``q`` in ``[-L, L]``. Summed
over ``p`` ranks (inside one uint8 all-reduce, or in int32 after an all-to-all), the field sum ``f``
gives the signed sum of the ``q`` as ``2f - p`` (sign) or ``f - pL`` (L1). Inside an all-reduce the
``p`` fields must not carry into their neighbours, which bounds ``p`` (and ``L``) by the width.

:class:`KbitCodec` holds these numbers for one configuration, validated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_lioncub.comm.vocabulary import KBIT_WIDTHS, KbitAlgorithm, Quantizer
from ds_lioncub.errors import LionCubConfigError


def field_width_for(max_value: int) -> int:
    """Smallest packable width (1, 2, 4, 8, 16 or 32 bits) that holds ``max_value``."""
    for width in (1, 2, 4, 8, 16, 32):
        if max_value <= (1 << width) - 1:
            return width
    raise ValueError(f"value {max_value} does not fit in 32 bits")


def l1_levels(world_size: int, bits: int, algorithm: KbitAlgorithm) -> int:
    """Quantization levels L (q in [-L, L]) for the L1 quantizer.

    With "allreduce" the p fields are summed inside one b-bit field, so the sum of the shifted values
    q + L (at most 2L each) must fit: p * 2L <= 2**b - 1. With "alltoall" the receiving rank sums in
    int32, so only one worker's value has to fit.
    """
    top = (1 << bits) - 1
    if algorithm == "allreduce":
        return top // (2 * world_size)
    return top // 2


def max_allreduce_world_size(bits: int, quantizer: Quantizer) -> int:
    """Largest p for which p fields of this quantizer can be summed in a b-bit field."""
    top = (1 << bits) - 1
    return top if quantizer == "sign" else top // 2


def check_kbit_world_size(world_size: int, bits: int, quantizer: Quantizer, algorithm: KbitAlgorithm) -> None:
    """Raise a :class:`LionCubConfigError` naming the fix when the world is too large for summed b-bit fields."""
    if bits not in KBIT_WIDTHS:
        raise LionCubConfigError(f"LionCub: bits must be one of {KBIT_WIDTHS}, got {bits!r}.")
    if algorithm != "allreduce":
        return
    largest = max_allreduce_world_size(bits, quantizer)
    if world_size <= largest:
        return
    wider = [b for b in KBIT_WIDTHS if b > bits and max_allreduce_world_size(b, quantizer) >= world_size]
    wider_hint = f"bits={wider[0]}, " if wider else ""
    raise LionCubConfigError(
        f"LionCub: {bits}-bit '{quantizer}' fields summed with kbit_algorithm='allreduce' hold at most "
        f"{largest} workers, but the data-parallel world has {world_size}. Use {wider_hint}"
        f"kbit_algorithm='alltoall' (field width independent of the world size), or compression='1bit'."
    )


@dataclass(frozen=True)
class KbitCodec:
    """The field arithmetic of one k-bit configuration over ``world_size`` ranks; build with :meth:`build`.

    Attributes:
        world_size: p, the ranks whose fields are summed.
        bits: b, the field width (2, 4 or 8).
        quantizer: "sign" (fields 0/1) or "l1" (fields ``q + L``).
        algorithm: "allreduce" (fields summed inside one uint8 all-reduce) or "alltoall" (summed in int32).
        levels: L: 1 for "sign"; for "l1" the most that keeps the (summed) field inside b bits.
    """

    world_size: int
    bits: int
    quantizer: Quantizer
    algorithm: KbitAlgorithm
    levels: int

    @classmethod
    def build(cls, world_size: int, bits: int, quantizer: Quantizer, algorithm: KbitAlgorithm) -> KbitCodec:
        """Validate the configuration for ``world_size`` ranks (raises :class:`LionCubConfigError`)."""
        check_kbit_world_size(world_size, bits, quantizer, algorithm)
        levels = 1 if quantizer == "sign" else l1_levels(world_size, bits, algorithm)
        if levels < 1:
            raise LionCubConfigError(
                f"LionCub: {bits}-bit l1 quantization leaves no levels for {world_size} workers "
                f"(L = floor((2**bits-1)/(2p)) = 0); use more bits or kbit_algorithm='alltoall'."
            )
        return cls(world_size, bits, quantizer, algorithm, levels)

    @property
    def max_field_sum(self) -> int:
        """The largest sum of ``p`` fields: p for sign fields, p * 2L for L1 fields."""
        return self.world_size * (1 if self.quantizer == "sign" else 2 * self.levels)

    @property
    def sum_width(self) -> int:
        """The narrowest packable width that holds any field sum (the "mean" all-gather's width)."""
        return field_width_for(self.max_field_sum)

    @property
    def mean_divisor(self) -> int:
        """The largest magnitude of a signed sum, p * L: "mean" divides by it to land in [-1, 1]."""
        return self.world_size * self.levels

    def signed_sum(self, field_sum: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' ``q`` from the sum of their fields: ``2f - p`` (sign) or ``f - pL`` (L1)."""
        if self.quantizer == "sign":
            return 2 * field_sum - self.world_size
        return field_sum - self.world_size * self.levels

    def vote_threshold(self, positive_ties: bool) -> int:
        """The smallest field sum whose vote is +1 (the signed sum is > 0, or == 0 when ties are positive).

        The vote then is one integer comparison of the field sums, with no signed sums computed.
        """
        least_positive = 0 if positive_ties else 1
        if self.quantizer == "sign":
            return (self.world_size + least_positive + 1) // 2  # ceil((p + least_positive) / 2)
        return self.world_size * self.levels + least_positive


__all__ = [
    "KBIT_WIDTHS",
    "KbitCodec",
    "check_kbit_world_size",
    "field_width_for",
    "l1_levels",
    "max_allreduce_world_size",
]
