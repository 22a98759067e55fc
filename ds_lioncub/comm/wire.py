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

- reduce-scatter (ring; ZeRO's gradient reduction): the first phase of the all-reduce alone,
  ``(p - 1) / p`` of the message.

A rank receives as many bytes as it sends in all four. At ``p = 1`` every count is 0: nothing leaves
the rank.

Per mode, the count is the sum over the collectives ``CompressedBackend`` issues for one
n-element update (see ``ds_lioncub/comm/backend.py``); the ``*_collectives`` functions list those
collectives (:class:`Collective`) and the ``*_bytes`` functions add them up.

Per link, for a cluster of nodes of ``G`` ranks each, numbered node-major (:func:`link_bytes`): how
many bytes cross one node's link to the network and how many one rank sends to ranks in its own
node, for a group that spans the whole cluster, for the G groups of one rank per node that the
ZeRO hybrid's votes run in (docs/design.md, section 12), or for a group inside one node.

ZeRO's collectives (:func:`zero2_collectives`, :func:`zero3_collectives`) are what the planner prices; the
engine runs them, and their counts are checked against the emulated network's link counters
(benchmarks/RESULTS.md, "ZeRO-3 hybrid on an emulated 2 x 2 cluster").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


def reduce_scatter_bytes(message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of ``message_bytes``: ``p - 1`` chunks of ``message_bytes / p``."""
    return message_bytes * (world_size - 1) // world_size


CollectiveKind = Literal["all_reduce", "all_gather", "all_to_all", "reduce_scatter"]

_BYTES_SENT = {
    "all_reduce": all_reduce_bytes,
    "all_gather": all_gather_bytes,
    "all_to_all": all_to_all_bytes,
    "reduce_scatter": reduce_scatter_bytes,
}


@dataclass(frozen=True)
class Collective:
    """One collective: what kind, each rank's input in bytes, and how many ranks take part."""

    kind: CollectiveKind
    message_bytes: int
    world_size: int

    @property
    def bytes_sent(self) -> int:
        """Bytes one rank sends (the per-collective counts above)."""
        return _BYTES_SENT[self.kind](self.message_bytes, self.world_size)


# ---------------------------------------------------------------------------------------------- per mode


def vote_padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size``: the length the votes' all-to-all carries.

    Every rank's chunk then holds a whole number of bytes of 1-bit (and of b-bit) fields.
    """
    multiple = 8 * world_size
    return (numel + multiple - 1) // multiple * multiple


def sign_vote_message_bytes(numel: int, world_size: int) -> int:
    """A rank's packed sign message for the 1-bit vote of ``numel`` elements: whole chunks of whole bytes."""
    return packed_length(vote_padded_numel(numel, world_size), 1)


def kbit_message_bytes(codec: KbitCodec, numel: int) -> int:
    """A rank's packed b-bit message of ``numel`` elements, padded as ``codec.algorithm`` needs (all-to-all:
    whole chunks of whole bytes, as the 1-bit vote; all-reduce: just whole bytes)."""
    if codec.algorithm == "allreduce":
        return packed_length(numel, codec.bits)
    return packed_length(vote_padded_numel(numel, codec.world_size), codec.bits)


def total_bytes_sent(collectives: list[Collective]) -> int:
    """Bytes one rank sends in all of ``collectives``."""
    return sum(collective.bytes_sent for collective in collectives)


def dense_all_reduce_collectives(numel: int, world_size: int, element_size: int) -> list[Collective]:
    """The uncompressed update: one all-reduce of ``numel`` values of ``element_size`` bytes (fp32: 4, bf16: 2)."""
    return [Collective("all_reduce", numel * element_size, world_size)]


def dense_all_reduce_bytes(numel: int, world_size: int, element_size: int) -> int:
    """Bytes of :func:`dense_all_reduce_collectives`."""
    return total_bytes_sent(dense_all_reduce_collectives(numel, world_size, element_size))


def vote_1bit_collectives(numel: int, world_size: int) -> list[Collective]:
    """The 1-bit vote: all-to-all of the packed signs, then all-gather of each rank's packed chunk of votes."""
    padded = vote_padded_numel(numel, world_size)
    return [
        Collective("all_to_all", sign_vote_message_bytes(numel, world_size), world_size),
        Collective("all_gather", packed_length(padded // world_size, 1), world_size),
    ]


def vote_1bit_bytes(numel: int, world_size: int) -> int:
    """Bytes of :func:`vote_1bit_collectives`."""
    return total_bytes_sent(vote_1bit_collectives(numel, world_size))


def kbit_collectives(numel: int, codec: KbitCodec, aggregation: Aggregation) -> list[Collective]:
    """The k-bit sums of ``codec`` (its width, quantizer, algorithm and world size), then a vote or a mean.

    "allreduce": one all-reduce of the packed b-bit fields; the vote and the mean are then local.
    "alltoall": all-to-all of the packed fields (padded like the 1-bit vote), each rank sums its
    chunk, then all-gather of the chunk's result: 1 bit per element for "vote", and for "mean" the
    field sums in the narrowest width that holds them (:attr:`KbitCodec.sum_width`).
    """
    p = codec.world_size
    if codec.algorithm == "allreduce":
        return [Collective("all_reduce", kbit_message_bytes(codec, numel), p)]
    padded = vote_padded_numel(numel, p)
    result_width = 1 if aggregation == "vote" else codec.sum_width
    return [
        Collective("all_to_all", kbit_message_bytes(codec, numel), p),
        Collective("all_gather", packed_length(padded // p, result_width), p),
    ]


def kbit_bytes(numel: int, codec: KbitCodec, aggregation: Aggregation) -> int:
    """Bytes of :func:`kbit_collectives`."""
    return total_bytes_sent(kbit_collectives(numel, codec, aggregation))


def finite_check_collectives(world_size: int) -> list[Collective]:
    """The compressed modes' per-step agreement that no rank has a non-finite gradient: one int32 all-reduce."""
    return [Collective("all_reduce", 4, world_size)]


def clip_sketch_collectives(sketch_bins: int, world_size: int) -> list[Collective]:
    """Option clip's per-step sum of the ranks' sketches: one fp64 all-reduce of ``sketch_bins`` numbers."""
    return [Collective("all_reduce", 8 * sketch_bins, world_size)]


def zero_partition_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's ZeRO partition of ``numel`` elements (the flat buffer padded to ``p`` equal parts)."""
    return (numel + world_size - 1) // world_size


def zero2_collectives(numel: int, world_size: int, element_size: int) -> list[Collective]:
    """ZeRO-1/2 over ``world_size`` ranks: a reduce-scatter of the gradients, an all-gather of the updated partitions.

    Both in ``element_size`` bytes per element (fp32 training: 4), modelled as bandwidth-optimal ring
    algorithms; together they send what one all-reduce of the same gradients sends.
    """
    partition = zero_partition_numel(numel, world_size)
    return [
        Collective("reduce_scatter", partition * world_size * element_size, world_size),
        Collective("all_gather", partition * element_size, world_size),
    ]


#: How often ZeRO-3 all-gathers a parameter per step: for the forward pass and again for the backward pass, once
#: the forward released it (every parameter above ``stage3_param_persistence_threshold``; at 0 every one).
ZERO3_PARAMETER_GATHERS = 2


def zero3_collectives(
    numel: int, world_size: int, element_size: int, gathers: int = ZERO3_PARAMETER_GATHERS
) -> list[Collective]:
    """ZeRO-3 over ``world_size`` ranks: ``gathers`` all-gathers of the parameter partitions, a reduce-scatter
    of the gradients.

    Each rank holds ``zero_partition_numel`` elements of the parameters; every gather brings the whole
    ``numel`` back (in ``element_size`` bytes, fp32 training: 4), and the gradients are reduce-scattered into
    the partitions as under ZeRO-2. No all-gather follows the step: the updated partitions are the
    parameters. Modelled as bandwidth-optimal rings, so each of the ``gathers + 1`` collectives sends half
    what one all-reduce of the gradients sends.
    """
    partition = zero_partition_numel(numel, world_size)
    return [Collective("all_gather", partition * element_size, world_size) for _ in range(gathers)] + [
        Collective("reduce_scatter", partition * world_size * element_size, world_size)
    ]


# ---------------------------------------------------------------------------------------------- per link

Placement = Literal["spanning", "one_per_node", "within_node"]


@dataclass(frozen=True)
class LinkBytes:
    """Where one collective's bytes go in a cluster of nodes.

    Attributes:
        node_link: bytes out of one node through its link to the network (shared by its ranks).
        within_node: bytes one rank sends to ranks of its own node.
    """

    node_link: int
    within_node: int


def link_bytes(collective: Collective, placement: Placement, node_size: int) -> LinkBytes:
    """The bytes of ``collective`` on each kind of link, ranks numbered node-major, ``node_size`` (G) per node.

    ``placement`` says which ranks form the collective's group:

    - "spanning": the whole cluster (``collective.world_size`` ranks, a multiple of G). A ring passes
      through each node once, so in every step one rank per node sends its chunk out of the node and
      the others send theirs inside it: the node link carries one rank's bytes. In a pairwise
      all-to-all each of the node's G ranks sends the chunks of the ``p - G`` ranks of other nodes
      out of the node, ``(p - G) / p`` of its message, and ``(G - 1) / p`` inside it.
    - "one_per_node": G groups of one rank per node run the same collective at once (the ZeRO
      hybrid's vote groups): all of it leaves the node, G times over.
    - "within_node": one node's ranks: nothing leaves the node.
    """
    sent = collective.bytes_sent
    p = collective.world_size
    if placement == "within_node" or (placement == "spanning" and p <= node_size):
        return LinkBytes(0, sent)
    if placement == "one_per_node":
        return LinkBytes(node_size * sent, 0)
    if collective.kind == "all_to_all":
        message = collective.message_bytes
        return LinkBytes(node_size * message * (p - node_size) // p, message * (node_size - 1) // p)
    return LinkBytes(sent, sent if node_size > 1 else 0)


__all__ = [
    "ZERO3_PARAMETER_GATHERS",
    "Collective",
    "CollectiveKind",
    "LinkBytes",
    "Placement",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "dense_all_reduce_bytes",
    "dense_all_reduce_collectives",
    "finite_check_collectives",
    "kbit_bytes",
    "kbit_collectives",
    "link_bytes",
    "reduce_scatter_bytes",
    "total_bytes_sent",
    "vote_1bit_bytes",
    "vote_1bit_collectives",
    "vote_padded_numel",
    "zero2_collectives",
    "zero3_collectives",
    "zero_partition_numel",
]
