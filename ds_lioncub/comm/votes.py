"""The wire protocols of the compressed aggregations, each in two phases.

Phase 1 (``start_*``) packs the local message and runs the first collective; phase 2 (``finish_*``)
reduces what arrived and, where the protocol has one, runs the second collective and unpacks the
result. Running ``start`` then ``finish`` is the whole aggregation; splitting them lets a caller do
other work between the two.

- 1-bit vote: all-to-all of packed signs (each rank receives every rank's signs for its chunk of
  the update), per-position majority on the chunk owner, all-gather of the packed chunk votes. The
  update is padded to a multiple of 8p elements with 0 (= -1) bits, so every chunk is whole bytes.
- k-bit sums, ``algorithm="allreduce"``: one uint8 SUM all-reduce of packed b-bit fields that cannot
  carry into each other (the world-size limit of :class:`~ds_lioncub.comm.kbit.KbitCodec`); phase 2
  only decodes.
- k-bit sums, ``algorithm="alltoall"``: all-to-all of the packed fields, int32 sums on the chunk
  owner, then an all-gather of the packed votes ("vote") or of the field sums in the narrowest width
  that holds them ("mean").

Zeros (a local sign of 0, a vote sum of 0) resolve to +1 when ``positive_ties`` is true, else -1.

The votes also have packed entries and exits (``start_sign_vote_packed``, ``finish_sign_vote_packed``,
``finish_kbit_vote_packed``): the caller hands over the message already packed (by the fused step
kernels, :func:`~ds_lioncub.comm.packing.lion_direction_pack_signs`) and gets the voted signs back
packed, one bit per element, instead of unpacked to ±1. The unpacked forms are these plus the packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.packing import (
    pack_fields,
    pack_l1_fields,
    pack_signs,
    packed_length,
    sum_fields_per_position,
    unpack_fields,
    unpack_signs,
    vote_packed_signs,
)
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.wire import vote_padded_numel


@dataclass
class PendingAggregate:
    """What phase 1 of a vote or sum leaves for phase 2.

    Attributes:
        received: the first collective's output: ``(p, bytes)`` rows after an all-to-all, the summed
            packed fields after a k-bit all-reduce.
        numel: elements of the update (before padding).
        positive_ties: the tie rule of this step.
    """

    received: torch.Tensor
    numel: int
    positive_ties: bool


# ---------------------------------------------------------------------------------------------------- 1-bit vote


def sign_vote_message_bytes(numel: int, world_size: int) -> int:
    """The length of a rank's packed sign message for ``numel`` elements: padded to whole chunks of whole bytes."""
    return vote_padded_numel(numel, world_size) // 8


def start_sign_vote(transport: Transport, update: torch.Tensor, positive_ties: bool) -> PendingAggregate:
    """Pack the signs of ``update`` (flat, non-empty) and exchange them by all-to-all."""
    numel = update.numel()
    message = pack_signs(update, positive_ties, nbytes=sign_vote_message_bytes(numel, transport.world_size))
    return start_sign_vote_packed(transport, message, numel, positive_ties)


def start_sign_vote_packed(
    transport: Transport, message: torch.Tensor, numel: int, positive_ties: bool
) -> PendingAggregate:
    """Exchange a packed sign message (``sign_vote_message_bytes(numel, p)`` bytes, padding bits 0) by all-to-all."""
    expected = sign_vote_message_bytes(numel, transport.world_size)
    if message.numel() != expected or message.dtype != torch.uint8:
        raise ValueError(f"a packed sign message of {numel} elements is {expected} uint8 bytes, got {message.numel()}")
    received = transport.all_to_all(message)
    return PendingAggregate(received.view(transport.world_size, -1), numel, positive_ties)


def finish_sign_vote(transport: Transport, pending: PendingAggregate, out: torch.Tensor) -> torch.Tensor:
    """Majority of the received signs of this rank's chunk, all-gathered and unpacked to ±1 into ``out``.

    ``out`` (contiguous, ``numel`` elements) may be the update whose signs were packed in phase 1.
    """
    return unpack_signs(finish_sign_vote_packed(transport, pending), pending.numel, out=out)


def finish_sign_vote_packed(transport: Transport, pending: PendingAggregate) -> torch.Tensor:
    """The voted signs, packed: bit ``i`` is element ``i``'s vote (1 = +1); at least ``ceil(numel/8)`` bytes."""
    chunk_numel = vote_padded_numel(pending.numel, transport.world_size) // transport.world_size
    # Fused: count, vote and pack in one pass over the packed messages (vote sum 2k - p; 0 is a tie).
    chunk_vote = vote_packed_signs(pending.received, chunk_numel, pending.positive_ties)
    return transport.all_gather(chunk_vote)


# ---------------------------------------------------------------------------------------------------- k-bit sums


def kbit_message_bytes(codec: KbitCodec, numel: int) -> int:
    """The length of a rank's packed k-bit message for ``numel`` elements, padded as ``codec.algorithm`` needs."""
    if codec.algorithm == "allreduce":
        return packed_length(numel, codec.bits)
    return vote_padded_numel(numel, codec.world_size) * codec.bits // 8  # all-to-all: whole chunks of whole bytes


def pack_kbit_message(
    codec: KbitCodec,
    update: torch.Tensor,
    positive_ties: bool,
    l1_scales: torch.Tensor | None = None,
    segment_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The packed b-bit fields of ``update`` (flat), padded as ``codec.algorithm`` needs.

    Sign fields are 1 for +1 and 0 for -1 (zeros by the tie rule); L1 fields are ``q + L`` with
    ``q = clamp(round(c * scale), -L, L)``, one fp32 scale per segment of ``segment_sizes``.
    """
    nbytes = kbit_message_bytes(codec, update.numel())
    if codec.quantizer == "sign":
        return pack_signs(update, positive_ties, bits=codec.bits, nbytes=nbytes)
    if l1_scales is None or segment_sizes is None:
        raise ValueError("pack_kbit_message: the L1 quantizer needs l1_scales and segment_sizes")
    return pack_l1_fields(update, l1_scales, segment_sizes, codec.levels, codec.bits, nbytes=nbytes)


def start_kbit_sum(
    transport: Transport, codec: KbitCodec, message: torch.Tensor, numel: int, positive_ties: bool
) -> PendingAggregate:
    """Run the first collective over the packed fields: the all-reduce, or the all-to-all."""
    if codec.algorithm == "allreduce":
        received = transport.all_reduce_sum(message)
    else:
        received = transport.all_to_all(message).view(transport.world_size, -1)
    return PendingAggregate(received, numel, positive_ties)


def finish_kbit_vote(
    transport: Transport, codec: KbitCodec, pending: PendingAggregate, out: torch.Tensor
) -> torch.Tensor:
    """The sign of the summed fields (ties by the tie rule) as ±1 into ``out`` (contiguous, ``numel`` elements)."""
    return unpack_signs(finish_kbit_vote_packed(transport, codec, pending), pending.numel, out=out)


def finish_kbit_vote_packed(transport: Transport, codec: KbitCodec, pending: PendingAggregate) -> torch.Tensor:
    """The sign of the summed fields (ties by the tie rule), packed one bit per element (1 = +1)."""
    # The vote straight from the field sums: one integer comparison, no signed sums in int32.
    threshold = codec.vote_threshold(pending.positive_ties)
    numel = pending.numel
    if codec.algorithm == "allreduce":
        fields = unpack_fields(pending.received, codec.bits, numel)
        # fits uint8: the codec's world-size limit keeps p * 2L (sign: p) < 2**bits
        return pack_fields(fields >= threshold, 1)
    chunk_numel = vote_padded_numel(numel, transport.world_size) // transport.world_size
    field_sum = sum_fields_per_position(pending.received, codec.bits, chunk_numel)
    return transport.all_gather(pack_fields(field_sum >= threshold, 1))


def finish_kbit_mean(
    transport: Transport, codec: KbitCodec, pending: PendingAggregate, out: torch.Tensor
) -> torch.Tensor:
    """The signed sum divided by its largest magnitude (p for sign, pL for L1), in [-1, 1], into ``out``."""
    numel = pending.numel
    if codec.algorithm == "allreduce":
        fields = unpack_fields(pending.received, codec.bits, numel)
    else:
        padded_numel = vote_padded_numel(numel, transport.world_size)
        field_sum = sum_fields_per_position(pending.received, codec.bits, padded_numel // transport.world_size)
        width = codec.sum_width
        if width <= 8:
            fields = unpack_fields(transport.all_gather(pack_fields(field_sum, width)), width, padded_numel)
        else:
            wide = torch.int16 if width == 16 else torch.int32
            fields = transport.all_gather(field_sum.to(wide).view(torch.uint8)).view(wide)
    total = codec.signed_sum(fields[:numel].to(torch.int32))
    return out.copy_((total.float() / codec.mean_divisor).view(out.shape))


__all__ = [
    "PendingAggregate",
    "finish_kbit_mean",
    "finish_kbit_vote",
    "finish_kbit_vote_packed",
    "finish_sign_vote",
    "finish_sign_vote_packed",
    "kbit_message_bytes",
    "pack_kbit_message",
    "sign_vote_message_bytes",
    "start_kbit_sum",
    "start_sign_vote",
    "start_sign_vote_packed",
]
