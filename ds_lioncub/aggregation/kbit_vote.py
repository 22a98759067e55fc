"""The k-bit vote: sums of the ranks' b-bit fields (signs or L1-quantized updates), voted or averaged."""

from __future__ import annotations

import torch

from ds_lioncub.aggregation.base import VoteStages
from ds_lioncub.aggregation.state import Bucket, KbitVoteState
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.packing import pack_l1_fields_of_means
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind
from ds_lioncub.comm.votes import (
    PendingAggregate,
    PendingResult,
    count_tied_kbit_sums,
    pack_kbit_message,
    reduce_kbit_mean,
    reduce_kbit_vote,
    start_kbit_sum,
)
from ds_lioncub.comm.wire import kbit_message_bytes


class KbitVote(VoteStages):
    """Sums of b-bit fields: the sign or the L1-quantized update of each rank, voted or averaged.

    Tuning: see :class:`KbitVoteState` (``bits``, ``quantizer``, ``kbit_algorithm``, ``aggregation``,
    ``l1_clip``, and the optimizer's ``bucket_size``).
    """

    reduces_gradients = False

    def __init__(self, transport: Transport, codec: KbitCodec, aggregation: AggregationKind, l1_clip: float) -> None:
        self.transport = transport
        self.state = KbitVoteState(codec, aggregation, l1_clip)
        self.needs_whole_tensor_mean_abs = codec.quantizer == "l1"

    @property
    def codec(self) -> KbitCodec:
        return self.state.codec

    @property
    def aggregation(self) -> AggregationKind:
        return self.state.aggregation

    @property
    def l1_clip(self) -> float:
        return self.state.l1_clip

    def start(self, bucket: Bucket, positive_ties: bool) -> PendingAggregate:
        return self.issue(self.pack(bucket, positive_ties), bucket.values.numel(), positive_ties)

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        """The message ``start`` would send for ``bucket``: its packed b-bit fields.

        L1: each piece's scale from its mean |c| (:func:`~ds_lioncub.comm.quantize.l1_segment_scales`), the
        scales, the quantizer and the packing in one pass where compiled (on a GPU no scale crosses to the host)."""
        if self.codec.quantizer == "l1":
            nbytes = kbit_message_bytes(self.codec, bucket.values.numel())
            codec = self.codec
            means = piece_means(bucket)
            return pack_l1_fields_of_means(
                bucket.values, means, bucket.piece_sizes, codec.levels, self.l1_clip, codec.bits, nbytes=nbytes
            )
        return pack_kbit_message(self.codec, bucket.values, positive_ties)

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        """``start`` for a message already packed by :meth:`pack` (or, for a vote of signs, to
        :meth:`sign_message_layout`)."""
        self.state.issued += 1
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

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        """Where the field sums ``f`` lie in ``[T(+), T(-))`` (docs/design.md section 4.6's thresholds; none
        for sign fields at odd p): this rank's chunk under "alltoall", every position under "allreduce"."""
        assert isinstance(pending, PendingAggregate)
        return count_tied_kbit_sums(self.transport, self.codec, pending), self.codec.algorithm == "alltoall"


def piece_means(bucket: Bucket) -> torch.Tensor:
    """Each piece's mu for the L1 scale: the whole tensor's mean |c| if given, else the piece's own."""
    means = []
    for piece, whole_mean in zip(bucket.values.split(bucket.piece_sizes), bucket.piece_mean_abs, strict=True):
        means.append(piece.abs().mean() if whole_mean is None else whole_mean)
    return torch.stack(means)
