"""The wire protocols of the compressed aggregations, each in two phases.

Phase 1 (``start_*``) packs the local message and issues the first collective; phase 2
(``reduce_*``) waits for it, reduces what arrived and issues the second collective where the protocol
has one; :func:`finish_aggregate` waits for that and unpacks the result. Nothing waits before it
must, so a caller can do other work, other buckets' included, between the three.

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

The sign votes (the 1-bit vote, the k-bit vote of sign fields) carry their result packed, one bit per
element (1 = +1), to the end: :func:`voted_signs_packed` hands those bits over as they are, so the
optimizer applies them in the same pass as the update (the fused step kernels of
:mod:`ds_lioncub.comm.packing`); :func:`finish_aggregate` unpacks them to ±1. Their messages may
likewise be packed by the caller (:func:`~ds_lioncub.comm.packing.lion_direction_pack_signs`) to the
lengths :mod:`ds_lioncub.comm.wire` gives (``sign_vote_message_bytes``, ``kbit_message_bytes``), and
issued as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.packing import (
    pack_fields,
    pack_l1_fields,
    pack_signs,
    sum_fields_per_position,
    unpack_fields,
    unpack_signs,
    vote_field_sums,
    vote_packed_signs,
)
from ds_lioncub.comm.transport import InFlight, Transport
from ds_lioncub.comm.wire import kbit_message_bytes, sign_vote_message_bytes, vote_padded_numel


@dataclass
class PendingAggregate:
    """What phase 1 of a vote or sum leaves for phase 2.

    Attributes:
        received: the first collective, issued: ``(p, bytes)`` rows after an all-to-all, the summed
            packed fields after a k-bit all-reduce, once waited for.
        numel: elements of the update (before padding).
        positive_ties: the tie rule of this step.
    """

    received: InFlight
    numel: int
    positive_ties: bool


@dataclass
class PendingResult:
    """What phase 2 leaves: the second collective, issued (or phase 2's local result), and its decoding.

    Attributes:
        gathered: the packed result, once waited for.
        numel: elements of the update.
        decode: ``decode(gathered, out)`` writes the result into ``out`` and returns it.
        packed_signs: whether ``gathered`` is the voted signs packed one bit per element (1 = +1),
            at least ``ceil(numel/8)`` bytes: the result of a sign vote.
    """

    gathered: InFlight
    numel: int
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    packed_signs: bool = False


def finish_aggregate(transport: Transport, result: PendingResult, out: torch.Tensor) -> torch.Tensor:
    """Wait for phase 2's collective and write the result into ``out`` (contiguous, ``numel`` elements)."""
    return result.decode(transport.wait(result.gathered), out)


def voted_signs_packed(transport: Transport, result: PendingResult) -> torch.Tensor:
    """Wait for a sign vote's phase 2 and return its voted signs packed, one bit per element (1 = +1)."""
    if not result.packed_signs:
        raise ValueError("voted_signs_packed: the result is not a vote of signs (a mean, or an L1 vote)")
    return transport.wait(result.gathered)


# ---------------------------------------------------------------------------------------------------- 1-bit vote


def pack_sign_message(world_size: int, update: torch.Tensor, positive_ties: bool) -> torch.Tensor:
    """The packed signs of ``update`` (flat), padded to whole bytes per rank's chunk with 0 (= -1) bits."""
    return pack_signs(update, positive_ties, nbytes=sign_vote_message_bytes(update.numel(), world_size))


def start_sign_vote(transport: Transport, update: torch.Tensor, positive_ties: bool) -> PendingAggregate:
    """Pack the signs of ``update`` (flat, non-empty) and issue their all-to-all.

    ``update`` is free for other use on return: only the packed signs travel.
    """
    message = pack_sign_message(transport.world_size, update, positive_ties)
    return issue_sign_vote(transport, message, update.numel(), positive_ties)


def issue_sign_vote(transport: Transport, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
    """Issue the all-to-all of a packed sign message (:func:`pack_sign_message`, or the same bytes packed
    elsewhere: ``sign_vote_message_bytes(numel, p)`` bytes, padding bits 0) of ``numel`` elements."""
    expected = sign_vote_message_bytes(numel, transport.world_size)
    if message.numel() != expected or message.dtype != torch.uint8:
        raise ValueError(f"a packed sign message of {numel} elements is {expected} uint8 bytes, got {message.numel()}")
    return PendingAggregate(transport.start_all_to_all(message), numel, positive_ties)


def reduce_sign_vote(transport: Transport, pending: PendingAggregate) -> PendingResult:
    """Majority of the received signs of this rank's chunk, its all-gather issued."""
    p, numel = transport.world_size, pending.numel
    chunk_numel = vote_padded_numel(numel, p) // p
    # Fused: count, vote and pack in one pass over the packed messages (vote sum 2k - p; 0 is a tie).
    chunk_vote = vote_packed_signs(transport.wait(pending.received).view(p, -1), chunk_numel, pending.positive_ties)
    return PendingResult(transport.start_all_gather(chunk_vote), numel, _unpacked_signs(numel), packed_signs=True)


Decoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _unpacked_signs(numel: int) -> Decoder:
    return lambda gathered, out: unpack_signs(gathered, numel, out=out)


# ---------------------------------------------------------------------------------------------------- k-bit sums


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
    """Issue the first collective over the packed fields (:func:`pack_kbit_message`, or the same bytes
    packed elsewhere: ``kbit_message_bytes(codec, numel)`` bytes): the all-reduce, or the all-to-all."""
    expected = kbit_message_bytes(codec, numel)
    if message.numel() != expected or message.dtype != torch.uint8:
        raise ValueError(f"a packed k-bit message of {numel} elements is {expected} uint8 bytes, got {message.numel()}")
    if codec.algorithm == "allreduce":
        received = transport.start_all_reduce_sum(message)
    else:
        received = transport.start_all_to_all(message)
    return PendingAggregate(received, numel, positive_ties)


def reduce_kbit_vote(transport: Transport, codec: KbitCodec, pending: PendingAggregate) -> PendingResult:
    """The vote of the summed fields (ties by the tie rule), packed; all-gathered under "alltoall"."""
    # The vote straight from the field sums: one integer comparison, no signed sums in int32, in one pass over the
    # packed fields (vote_field_sums: unpack or sum, compare and pack; one kernel on a GPU).
    threshold = codec.vote_threshold(pending.positive_ties)
    numel = pending.numel
    received = transport.wait(pending.received)
    if codec.algorithm == "allreduce":
        # the summed message is one row of fields; they fit uint8: the codec's world-size limit keeps p * 2L
        # (sign: p) < 2**bits
        voted = vote_field_sums(received.reshape(1, -1), codec.bits, numel, threshold)
        return PendingResult(InFlight(voted), numel, _unpacked_signs(numel), packed_signs=True)
    p = transport.world_size
    chunk_numel = vote_padded_numel(numel, p) // p
    gathered = transport.start_all_gather(vote_field_sums(received.view(p, -1), codec.bits, chunk_numel, threshold))
    return PendingResult(gathered, numel, _unpacked_signs(numel), packed_signs=True)


def reduce_kbit_mean(transport: Transport, codec: KbitCodec, pending: PendingAggregate) -> PendingResult:
    """The field sums of every position: the all-reduce's own, or this chunk's, all-gathered under "alltoall"."""
    numel = pending.numel
    received = transport.wait(pending.received)
    if codec.algorithm == "allreduce":
        return PendingResult(InFlight(received), numel, _mean_of_field_sums(codec, codec.bits, numel))
    p = transport.world_size
    padded_numel = vote_padded_numel(numel, p)
    field_sum = sum_fields_per_position(received.view(p, -1), codec.bits, padded_numel // p)
    width = codec.sum_width
    if width <= 8:
        gathered = transport.start_all_gather(pack_fields(field_sum, width))
    else:
        gathered = transport.start_all_gather(field_sum.to(_WIDE_SUMS[width]).view(torch.uint8))
    return PendingResult(gathered, numel, _mean_of_field_sums(codec, width, padded_numel))


_WIDE_SUMS = {16: torch.int16, 32: torch.int32}


def _mean_of_field_sums(codec: KbitCodec, width: int, count: int) -> Decoder:
    """Decodes ``count`` field sums (packed ``width``-bit fields, or int16/int32 values) into their mean."""

    def decode(sums: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        fields = unpack_fields(sums, width, count) if width <= 8 else sums.view(_WIDE_SUMS[width])
        total = codec.signed_sum(fields[: out.numel()].to(torch.int32))
        return out.copy_((total.float() / codec.mean_divisor).view(out.shape))

    return decode


# Set bits of each byte value: a popcount as one histogram of the bytes (bincount, on any device).
_SET_BITS_PER_BYTE = torch.tensor([bin(value).count("1") for value in range(256)], dtype=torch.int64)


def count_set_bits(packed: torch.Tensor) -> torch.Tensor:
    """The number of 1 bits in a uint8 tensor (int64, one element), in one pass over its bytes."""
    histogram = torch.bincount(packed.reshape(-1), minlength=256)
    return (histogram * _SET_BITS_PER_BYTE.to(histogram.device)).sum()


def count_tied_sign_votes(transport: Transport, pending: PendingAggregate) -> torch.Tensor:
    """Tied positions of this rank's chunk of a 1-bit vote whose rows have arrived: where the votes with
    positive and with negative ties differ (the chunk layout of :func:`reduce_sign_vote`)."""
    p = transport.world_size
    chunk_numel = vote_padded_numel(pending.numel, p) // p
    rows = transport.wait(pending.received).view(p, -1)  # already done: the bucket's vote is complete
    with_positive = vote_packed_signs(rows, chunk_numel, True)
    with_negative = vote_packed_signs(rows, chunk_numel, False)
    return count_set_bits(torch.bitwise_xor(with_positive, with_negative))


def count_tied_kbit_sums(transport: Transport, codec: KbitCodec, pending: PendingAggregate) -> torch.Tensor:
    """Tied positions of a k-bit sum whose first collective has arrived: field sums ``f`` in
    ``[T(+), T(-))``, over every position under "allreduce", over this rank's chunk under "alltoall"
    (the layouts of :func:`reduce_kbit_vote`). Padding sums to 0, below ``T(+)``: it never ties."""
    received = transport.wait(pending.received)  # already done: the bucket's vote is complete
    if codec.algorithm == "allreduce":
        sums = unpack_fields(received, codec.bits, pending.numel)
    else:
        chunk_numel = vote_padded_numel(pending.numel, codec.world_size) // codec.world_size
        sums = sum_fields_per_position(received.view(codec.world_size, -1), codec.bits, chunk_numel)
    low, high = codec.vote_threshold(True), codec.vote_threshold(False)
    histogram = torch.bincount(sums.reshape(-1), minlength=high)
    return histogram[low:high].sum()


__all__ = [
    "PendingAggregate",
    "PendingResult",
    "count_set_bits",
    "count_tied_kbit_sums",
    "count_tied_sign_votes",
    "finish_aggregate",
    "issue_sign_vote",
    "pack_kbit_message",
    "pack_sign_message",
    "reduce_kbit_mean",
    "reduce_kbit_vote",
    "reduce_sign_vote",
    "start_kbit_sum",
    "start_sign_vote",
    "voted_signs_packed",
]
