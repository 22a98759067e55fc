"""The 1-bit vote: the majority of the ranks' signs, one bit per element."""

from __future__ import annotations

import torch

from ds_lioncub.aggregation.base import VoteStages
from ds_lioncub.aggregation.state import Bucket, OneBitVoteState
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.votes import (
    PendingAggregate,
    PendingResult,
    count_tied_sign_votes,
    issue_sign_vote,
    pack_sign_message,
    reduce_sign_vote,
    start_sign_vote,
)
from ds_lioncub.comm.wire import sign_vote_message_bytes


class OneBitVote(VoteStages):
    """The majority vote of the ranks' signs: 1 bit per element in each of two collectives.

    Every rank sends ``2 (p-1)/p * n/8`` bytes per step for ``n`` elements (32x fewer than an fp32
    ring all-reduce). There is nothing to tune here but ``bucket_size`` (see :class:`KbitVote`).
    """

    reduces_gradients = False
    needs_whole_tensor_mean_abs = False

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.state = OneBitVoteState()

    def start(self, bucket: Bucket, positive_ties: bool) -> PendingAggregate:
        self.state.issued += 1
        return start_sign_vote(self.transport, bucket.values, positive_ties)

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        """The message ``start`` would send for ``bucket``: its packed signs."""
        return pack_sign_message(self.transport.world_size, bucket.values, positive_ties)

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        """``start`` for a message already packed by :meth:`pack` (or to :meth:`sign_message_layout`)."""
        self.state.issued += 1
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

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        """Where the votes with positive and with negative ties differ, on this rank's chunk (an owner's share)."""
        assert isinstance(pending, PendingAggregate)
        return count_tied_sign_votes(self.transport, pending), True
