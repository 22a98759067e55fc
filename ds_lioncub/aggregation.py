"""How the ranks' buckets become one result: exact mean, 1-bit vote, or k-bit sums.

An aggregation is built once, from the validated options and the transport (all option checks,
the world-size limits of the k-bit fields included, happen in :func:`build_aggregation`), and then
serves every bucket of every step in two phases:

- ``start(bucket, positive_ties) -> pending``: pack the bucket and run the first collective;
- ``finish(pending, out) -> result``: reduce what arrived, run the second collective if there is
  one, and write the result into ``out``.

A synchronous step calls ``start`` then ``finish`` per bucket. The three kinds differ in what they
aggregate: :class:`ExactMean` averages gradients (exact Lion then runs on the mean), while
:class:`OneBitVote` and :class:`KbitVote` aggregate each rank's pre-sign update ``c`` and return
the direction every rank applies (±1, or a mean in [-1, 1]).

The sign votes (the 1-bit vote, and the k-bit vote of sign fields) also take their message packed
and give the voted signs back packed (:class:`PackedSignVote`: ``sign_message_layout``,
``start_packed``, ``finish_packed``), so the optimizer can build the message in the same pass as
Lion's direction and apply the packed result in the same pass as the update (the fused kernels of
:mod:`ds_lioncub.comm.packing`); :func:`packed_sign_vote` says whether an aggregation offers it.
``start`` then ``finish`` is the same vote with the packing and unpacking done here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ds_lioncub.comm.backend import l1_segment_scales
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind
from ds_lioncub.comm.votes import (
    PendingAggregate,
    finish_kbit_mean,
    finish_kbit_vote,
    finish_kbit_vote_packed,
    finish_sign_vote,
    finish_sign_vote_packed,
    kbit_message_bytes,
    pack_kbit_message,
    sign_vote_message_bytes,
    start_kbit_sum,
    start_sign_vote,
    start_sign_vote_packed,
)
from ds_lioncub.config import LionCubConfig

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Bucket:
    """One bucket of a step: flat fp32 values cut into parameter pieces.

    Attributes:
        values: the ranks' local values, contiguous fp32: gradients for :class:`ExactMean`,
            pre-sign updates ``c`` for the votes.
        piece_sizes: elements of each parameter piece, in order; they add up to ``values.numel()``.
        piece_mean_abs: for the L1 quantizer, mean |c| of the WHOLE tensor a piece was cut from
            (``None`` where the piece is a whole tensor: its own mean is used). Empty otherwise.
    """

    values: torch.Tensor
    piece_sizes: list[int]
    piece_mean_abs: list[torch.Tensor | None]


class Aggregator(Protocol):
    """The two phases every aggregation offers (see the module docstring)."""

    #: True when the aggregation averages gradients (exact Lion), False when it votes on ``c``.
    reduces_gradients: bool
    #: True when :class:`Bucket` needs ``piece_mean_abs`` for pieces cut from larger tensors.
    needs_whole_tensor_mean_abs: bool

    def start(self, bucket: Bucket, positive_ties: bool) -> object: ...

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor: ...


class PackedSignVote(Protocol):
    """A vote on packed sign fields whose result is ±1, entered and left packed."""

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        """(bits per sign field, message bytes) of a rank's message for ``numel`` elements."""
        ...

    def start_packed(self, message: torch.Tensor, numel: int, positive_ties: bool) -> object:
        """``start`` for a message already packed as ``pack_signs(c, positive_ties, bits=..., nbytes=...)``."""
        ...

    def finish_packed(self, pending: object) -> torch.Tensor:
        """The voted signs packed one bit per element (1 = +1), at least ``ceil(numel/8)`` bytes."""
        ...


class ExactMean:
    """The mean of the ranks' tensors: one all-reduce per bucket in ``comm_dtype``, rounded back to fp32.

    Exact Lion averages gradients with it; momentum sync averages momenta. The sum runs in rank
    order (see :mod:`ds_lioncub.comm.transport`), so every rank gets the same bits.

    Tuning: ``comm_dtype`` fp32 is exact; bf16 halves the bytes and rounds each rank's contribution
    and the sum to bf16's 8 significant bits, which Lion's sign usually shrugs off for gradients.
    """

    reduces_gradients = True
    needs_whole_tensor_mean_abs = False

    def __init__(self, transport: Transport, comm_dtype: torch.dtype = torch.float32) -> None:
        self.transport = transport
        self.comm_dtype = comm_dtype

    def start(self, bucket: Bucket, positive_ties: bool = True) -> torch.Tensor:
        """The rank-order sum of the bucket in ``comm_dtype`` (no ties: nothing is signed)."""
        return self.transport.all_reduce_sum(bucket.values.to(self.comm_dtype))

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean in fp32, into ``out`` when given."""
        assert isinstance(pending, torch.Tensor)
        mean = pending.float().div_(self.transport.world_size)
        return mean if out is None else out.copy_(mean)


class OneBitVote:
    """The majority vote of the ranks' signs: 1 bit per element in each of two collectives.

    Every rank sends ``2 (p-1)/p * n/8`` bytes per step for ``n`` elements (32x fewer than an fp32
    ring all-reduce). There is nothing to tune here but ``bucket_size`` (see :class:`KbitVote`).
    """

    reduces_gradients = False
    needs_whole_tensor_mean_abs = False

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def start(self, bucket: Bucket, positive_ties: bool) -> PendingAggregate:
        return start_sign_vote(self.transport, bucket.values, positive_ties)

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """±1 per element into ``out``, which may be the bucket's own values (already packed)."""
        assert isinstance(pending, PendingAggregate)
        target = torch.empty(pending.numel, dtype=torch.float32, device=pending.received.device) if out is None else out
        return finish_sign_vote(self.transport, pending, target)

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        return 1, sign_vote_message_bytes(numel, self.transport.world_size)

    def start_packed(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        return start_sign_vote_packed(self.transport, message, numel, positive_ties)

    def finish_packed(self, pending: object) -> torch.Tensor:
        assert isinstance(pending, PendingAggregate)
        return finish_sign_vote_packed(self.transport, pending)


class KbitVote:
    """Sums of b-bit fields: the sign or the L1-quantized update of each rank, voted or averaged.

    Tuning:

    - ``bits``: 2, 4 or 8 bits per element on the wire. With the sign quantizer more bits only buy
      a larger all-reduce world (``2**bits - 1`` ranks); with L1 they buy resolution
      (``L = floor((2**bits - 1) / (2p))`` levels under all-reduce, ``(2**bits - 1) // 2`` under
      all-to-all). Start with 4-bit sign; move to 8-bit L1 when the vote loses quality.
    - ``kbit_algorithm``: "allreduce" sends ``2 (p-1)/p * n * bits/8`` bytes in one collective but
      holds only small worlds; "alltoall" holds any world, sends ``(p-1)/p * n * (bits + 1)/8``
      for a vote, and keeps L1's levels independent of ``p``.
    - ``aggregation``: "vote" applies the sign of the sum (±1, Lion's update size); "mean" applies
      the sum over its largest magnitude, a smaller step where the ranks disagree.
    - ``l1_clip`` (tau): the L1 quantizer saturates at tau * mean|c|. 2 is the paper's setting;
      larger keeps more outliers at the cost of resolution near zero.
    - ``bucket_size`` (all modes): elements per collective. Larger buckets mean fewer, larger
      messages (less latency per byte) and larger temporaries (about one bucket, more for L1).
    """

    reduces_gradients = False

    def __init__(self, transport: Transport, codec: KbitCodec, aggregation: AggregationKind, l1_clip: float) -> None:
        self.transport = transport
        self.codec = codec
        self.aggregation = aggregation
        self.l1_clip = l1_clip
        self.needs_whole_tensor_mean_abs = codec.quantizer == "l1"

    def start(self, bucket: Bucket, positive_ties: bool) -> PendingAggregate:
        sizes, scales = None, None
        if self.codec.quantizer == "l1":
            means = _piece_means(bucket)
            sizes, scales = l1_segment_scales(bucket.values, self.codec.levels, self.l1_clip, bucket.piece_sizes, means)
        message = pack_kbit_message(self.codec, bucket.values, positive_ties, scales, sizes)
        return start_kbit_sum(self.transport, self.codec, message, bucket.values.numel(), positive_ties)

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(pending, PendingAggregate)
        target = torch.empty(pending.numel, dtype=torch.float32, device=pending.received.device) if out is None else out
        if self.aggregation == "vote":
            return finish_kbit_vote(self.transport, self.codec, pending, target)
        return finish_kbit_mean(self.transport, self.codec, pending, target)

    @property
    def votes_packed_signs(self) -> bool:
        """Whether this is a vote of sign fields (the packed entry and exit apply)."""
        return self.codec.quantizer == "sign" and self.aggregation == "vote"

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        self._require_packed_sign_vote()
        return self.codec.bits, kbit_message_bytes(self.codec, numel)

    def start_packed(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        self._require_packed_sign_vote()
        expected = kbit_message_bytes(self.codec, numel)
        if message.numel() != expected or message.dtype != torch.uint8:
            raise ValueError(
                f"a packed k-bit message of {numel} elements is {expected} uint8 bytes, got {message.numel()}"
            )
        return start_kbit_sum(self.transport, self.codec, message, numel, positive_ties)

    def finish_packed(self, pending: object) -> torch.Tensor:
        self._require_packed_sign_vote()
        assert isinstance(pending, PendingAggregate)
        return finish_kbit_vote_packed(self.transport, self.codec, pending)

    def _require_packed_sign_vote(self) -> None:
        if not self.votes_packed_signs:
            raise ValueError(
                f"the packed entry and exit are for votes of sign fields, not quantizer={self.codec.quantizer!r} "
                f"with aggregation={self.aggregation!r}"
            )


def _piece_means(bucket: Bucket) -> torch.Tensor:
    """Each piece's mu for the L1 scale: the whole tensor's mean |c| if given, else the piece's own."""
    means = []
    for piece, whole_mean in zip(bucket.values.split(bucket.piece_sizes), bucket.piece_mean_abs, strict=True):
        means.append(piece.abs().mean() if whole_mean is None else whole_mean)
    return torch.stack(means)


def packed_sign_vote(aggregator: Aggregator) -> PackedSignVote | None:
    """``aggregator`` as a :class:`PackedSignVote` when it is one (1-bit vote, k-bit vote of signs), else None."""
    if isinstance(aggregator, OneBitVote):
        return aggregator
    if isinstance(aggregator, KbitVote) and aggregator.votes_packed_signs:
        return aggregator
    return None


def build_aggregation(options: LionCubConfig, transport: Transport, gradients_averaged: bool) -> Aggregator | None:
    """The aggregation ``options`` ask for over ``transport``, validated for its world size.

    ``None`` means the gradients are used as they are: exact Lion alone, or on gradients the
    caller (DeepSpeed's engine) has already averaged. Raises :class:`~ds_lioncub.errors.LionCubConfigError`
    (on every rank alike: the inputs are the same everywhere) when the k-bit fields cannot hold the world.
    """
    if options.compression == "none":
        if transport.world_size == 1 or gradients_averaged:
            return None
        return ExactMean(transport, COMM_DTYPES[options.comm_dtype])
    if options.compression == "1bit":
        return OneBitVote(transport)
    codec = KbitCodec.build(transport.world_size, options.bits, options.quantizer, options.kbit_algorithm)
    return KbitVote(transport, codec, options.aggregation, options.l1_clip)


__all__ = [
    "COMM_DTYPES",
    "Aggregator",
    "Bucket",
    "ExactMean",
    "KbitVote",
    "OneBitVote",
    "PackedSignVote",
    "build_aggregation",
    "packed_sign_vote",
]
