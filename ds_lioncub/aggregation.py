"""How the ranks' buckets become one result: exact mean, 1-bit vote, or k-bit sums.

An aggregation is built once, from the validated options and the transport (all option checks,
the world-size limits of the k-bit fields included, happen in :func:`build_aggregation`), and then
serves every bucket of every step in three stages, none of which waits before it must:

- ``start(bucket, positive_ties) -> pending``: pack the bucket and issue the first collective (the
  bucket's values are free again on return);
- ``reduce(pending) -> result``: wait for it, reduce what arrived, issue the second collective if
  there is one;
- ``complete(result, out) -> tensor``: wait for that and write the result into ``out``.

``finish(pending, out)`` is ``complete(reduce(pending), out)``. Collectives are issued in the order
the stages run, which must be the same on every rank; the optimizer's bucket schedule
(:mod:`ds_lioncub.optimizer`) keeps it so. The three kinds differ in what they
aggregate: :class:`ExactMean` averages gradients (exact Lion then runs on the mean), while
:class:`OneBitVote` and :class:`KbitVote` aggregate each rank's pre-sign update ``c`` and return
the direction every rank applies (±1, or a mean in [-1, 1]).

The sign votes (:attr:`_VoteStages.votes_packed_signs`: the 1-bit vote, the k-bit vote of sign fields)
are also entered and left packed, so the optimizer can build the message in the same pass as Lion's
direction and apply the voted signs in the same pass as the update (the fused kernels of
:mod:`ds_lioncub.comm.packing`, docs/design.md section 5.1): :meth:`_VoteStages.sign_message_layout`
says how to pack the message that :meth:`_VoteStages.issue` sends, and
:meth:`_VoteStages.complete_packed` gives the voted signs packed, one bit per element, instead of
unpacked to ±1. ``start`` is ``issue(pack(bucket))`` with the packing done here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.quantize import l1_segment_scales
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind
from ds_lioncub.comm.votes import (
    PendingAggregate,
    PendingResult,
    finish_aggregate,
    issue_sign_vote,
    pack_kbit_message,
    pack_sign_message,
    reduce_kbit_mean,
    reduce_kbit_vote,
    reduce_sign_vote,
    start_kbit_sum,
    start_sign_vote,
    voted_signs_packed,
)
from ds_lioncub.comm.wire import kbit_message_bytes, sign_vote_message_bytes
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
    """The stages every aggregation offers (see the module docstring)."""

    #: The ranks it aggregates over.
    transport: Transport
    #: True when the aggregation averages gradients (exact Lion), False when it votes on ``c``.
    reduces_gradients: bool
    #: True when :class:`Bucket` needs ``piece_mean_abs`` for pieces cut from larger tensors.
    needs_whole_tensor_mean_abs: bool

    def start(self, bucket: Bucket, positive_ties: bool) -> object: ...

    def reduce(self, pending: object) -> object: ...

    def complete(self, result: object, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor: ...


class _VoteStages:
    """``reduce``'s result written out, and ``finish``, shared by the votes.

    A vote's ``start`` is ``issue(pack(bucket))``: :meth:`pack` makes the bucket's message (bytes that
    fix the vote's outcome together with the other ranks' and the tie rule), :meth:`issue` sends it.
    """

    transport: Transport

    def complete(self, result: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """The result (±1, or a mean in [-1, 1]) into ``out``, which may be the bucket's own values."""
        assert isinstance(result, PendingResult)
        target = torch.empty(result.numel, dtype=torch.float32, device=result.gathered.device) if out is None else out
        return finish_aggregate(self.transport, result, target)

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.complete(self.reduce(pending), out)

    def complete_packed(self, result: object) -> torch.Tensor:
        """A sign vote's result packed one bit per element (1 = +1), at least ``ceil(numel/8)`` bytes:
        what :meth:`complete` would unpack to ±1."""
        self._require_sign_vote()
        assert isinstance(result, PendingResult)
        return voted_signs_packed(self.transport, result)

    @property
    def votes_packed_signs(self) -> bool:
        """Whether this is a vote of sign fields, whose message and result can be packed by the caller."""
        raise NotImplementedError

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        """(bits per sign field, bytes) of the message :meth:`issue` takes for ``numel`` elements, to be
        packed as ``pack_signs(c, positive_ties, bits=..., nbytes=...)`` (a sign vote only)."""
        raise NotImplementedError

    def _require_sign_vote(self) -> None:
        if not self.votes_packed_signs:
            raise ValueError(f"the packed message and result are for votes of sign fields, not {self!r}")

    def reduce(self, pending: object) -> object:
        raise NotImplementedError

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        raise NotImplementedError

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        raise NotImplementedError


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
        """The rank-order sum of the bucket in ``comm_dtype`` (no ties: nothing is signed), run to the end:
        its reduction is local work between two collectives."""
        return self.transport.all_reduce_sum(bucket.values.to(self.comm_dtype))

    def reduce(self, pending: object) -> object:
        return pending

    def complete(self, result: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean in fp32, into ``out`` when given."""
        assert isinstance(result, torch.Tensor)
        mean = result.float().div_(self.transport.world_size)
        return mean if out is None else out.copy_(mean)

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.complete(self.reduce(pending), out)


class OneBitVote(_VoteStages):
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

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        """The message ``start`` would send for ``bucket``: its packed signs."""
        return pack_sign_message(self.transport.world_size, bucket.values, positive_ties)

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        """``start`` for a message already packed by :meth:`pack` (or to :meth:`sign_message_layout`)."""
        return issue_sign_vote(self.transport, message, numel, positive_ties)

    @property
    def votes_packed_signs(self) -> bool:
        return True

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        return 1, sign_vote_message_bytes(numel, self.transport.world_size)

    def __repr__(self) -> str:
        return "OneBitVote()"

    def reduce(self, pending: object) -> PendingResult:
        assert isinstance(pending, PendingAggregate)
        return reduce_sign_vote(self.transport, pending)


class KbitVote(_VoteStages):
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
        return self.issue(self.pack(bucket, positive_ties), bucket.values.numel(), positive_ties)

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        """The message ``start`` would send for ``bucket``: its packed b-bit fields."""
        sizes, scales = None, None
        if self.codec.quantizer == "l1":
            means = _piece_means(bucket)
            sizes, scales = l1_segment_scales(bucket.values, self.codec.levels, self.l1_clip, bucket.piece_sizes, means)
        return pack_kbit_message(self.codec, bucket.values, positive_ties, scales, sizes)

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        """``start`` for a message already packed by :meth:`pack` (or, for a vote of signs, to
        :meth:`sign_message_layout`)."""
        return start_kbit_sum(self.transport, self.codec, message, numel, positive_ties)

    @property
    def votes_packed_signs(self) -> bool:
        return self.codec.quantizer == "sign" and self.aggregation == "vote"

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        self._require_sign_vote()
        return self.codec.bits, kbit_message_bytes(self.codec, numel)

    def __repr__(self) -> str:
        return f"KbitVote(quantizer={self.codec.quantizer!r}, aggregation={self.aggregation!r})"

    def reduce(self, pending: object) -> PendingResult:
        assert isinstance(pending, PendingAggregate)
        if self.aggregation == "vote":
            return reduce_kbit_vote(self.transport, self.codec, pending)
        return reduce_kbit_mean(self.transport, self.codec, pending)


def _piece_means(bucket: Bucket) -> torch.Tensor:
    """Each piece's mu for the L1 scale: the whole tensor's mean |c| if given, else the piece's own."""
    means = []
    for piece, whole_mean in zip(bucket.values.split(bucket.piece_sizes), bucket.piece_mean_abs, strict=True):
        means.append(piece.abs().mean() if whole_mean is None else whole_mean)
    return torch.stack(means)


def packed_sign_vote(aggregator: Aggregator) -> Vote | None:
    """``aggregator`` when it is a vote of sign fields (1-bit vote, k-bit vote of signs), else None."""
    if isinstance(aggregator, (OneBitVote, KbitVote)) and aggregator.votes_packed_signs:
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


Vote = OneBitVote | KbitVote

__all__ = [
    "COMM_DTYPES",
    "Aggregator",
    "Bucket",
    "ExactMean",
    "KbitVote",
    "OneBitVote",
    "Vote",
    "build_aggregation",
    "packed_sign_vote",
]
