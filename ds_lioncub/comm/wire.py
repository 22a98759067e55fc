"""How many bytes each rank sends: per collective, and per aggregation mode of an n-element update.

These formulas exist only here. The transports count their traffic with the per-collective
functions, and the benchmarks compare measured wire bytes with the per-mode functions, so the
counters and the model cannot drift apart.

Per collective, the count is what a bandwidth-optimal algorithm sends per rank for a message of
``message_bytes`` bytes (the size of one rank's input) over ``world_size`` ranks ``p``:

- all-to-all (pairwise exchange): each rank keeps its own chunk and sends the other ``p - 1``
  chunks, ``(p - 1) / p`` of its message;
- all-gather (ring): each rank forwards ``p - 1`` messages, its own and those it received;
- all-reduce (ring reduce-scatter, then ring all-gather of the reduced chunks): ``p - 1`` chunks of
  ``message_bytes / p`` in each of the two phases, ``2 (p - 1) / p`` of the message. When the
  message does not split into ``p`` equal chunks the ranks send slightly different amounts; the
  count is their mean, rounded down.

A rank receives as many bytes as it sends in all three. At ``p = 1`` every count is 0: nothing leaves
the rank.

Per mode, the count is the sum over the collectives ``CompressedBackend`` issues for one
n-element update (see ``ds_lioncub/comm/backend.py``).
"""

from __future__ import annotations

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.packing import packed_length
from ds_lioncub.comm.vocabulary import Aggregation

# ---------------------------------------------------------------------------------------------- per collective


def all_to_all_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-to-all of ``message_bytes`` (split into ``world_size`` equal chunks)."""
    return message_bytes * (world_size - 1) // world_size


def all_gather_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather where every rank contributes ``message_bytes``."""
    return message_bytes * (world_size - 1)


def all_reduce_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends, on average over ranks, in a ring all-reduce of ``message_bytes``."""
    return 2 * message_bytes * (world_size - 1) // world_size


# ---------------------------------------------------------------------------------------------- per mode


def vote_padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size``: the length the votes' all-to-all carries.

    Every rank's chunk then holds a whole number of bytes of 1-bit (and of b-bit) fields.
    """
    multiple = 8 * world_size
    return (numel + multiple - 1) // multiple * multiple


def dense_all_reduce_bytes(numel: int, world_size: int, element_size: int) -> int:
    """The uncompressed update: one all-reduce of ``numel`` values of ``element_size`` bytes (fp32: 4, bf16: 2)."""
    return all_reduce_bytes(numel * element_size, world_size)


def vote_1bit_bytes(numel: int, world_size: int) -> int:
    """The 1-bit vote: all-to-all of the packed signs, then all-gather of each rank's packed chunk of votes."""
    padded = vote_padded_numel(numel, world_size)
    signs = all_to_all_bytes(packed_length(padded, 1), world_size)
    votes = all_gather_bytes(packed_length(padded // world_size, 1), world_size)
    return signs + votes


def kbit_bytes(numel: int, codec: KbitCodec, aggregation: Aggregation) -> int:
    """The k-bit sums of ``codec`` (its width, quantizer, algorithm and world size), then a vote or a mean.

    "allreduce": one all-reduce of the packed b-bit fields; the vote and the mean are then local.
    "alltoall": all-to-all of the packed fields (padded like the 1-bit vote), each rank sums its
    chunk, then all-gather of the chunk's result: 1 bit per element for "vote", and for "mean" the
    field sums in the narrowest width that holds them (:attr:`KbitCodec.sum_width`).
    """
    p, bits = codec.world_size, codec.bits
    if codec.algorithm == "allreduce":
        return all_reduce_bytes(packed_length(numel, bits), p)
    padded = vote_padded_numel(numel, p)
    fields = all_to_all_bytes(packed_length(padded, bits), p)
    result_width = 1 if aggregation == "vote" else codec.sum_width
    return fields + all_gather_bytes(packed_length(padded // p, result_width), p)


__all__ = [
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "dense_all_reduce_bytes",
    "kbit_bytes",
    "vote_1bit_bytes",
    "vote_padded_numel",
]
