"""What every aggregation offers (:class:`Aggregator`), and the stages the votes share (:class:`VoteStages`).

An aggregation is built once, from the validated options and the transport
(:func:`~ds_lioncub.aggregation.build_aggregation`), and then serves every bucket of every step in three
stages, none of which waits before it must:

- ``start(bucket, positive_ties) -> pending``: pack the bucket and issue the first collective (the
  bucket's values are free again on return);
- ``reduce(pending) -> result``: wait for it, reduce what arrived, issue the second collective if
  there is one;
- ``complete(result, out) -> tensor``: wait for that and write the result into ``out``.

``finish(pending, out)`` is ``complete(reduce(pending), out)``. Collectives are issued in the order
the stages run, which must be the same on every rank; the optimizer's bucket schedule
(:mod:`ds_lioncub.step.paths`) keeps it so. The three kinds differ in what they
aggregate: :class:`ExactMean` averages gradients (exact Lion then runs on the mean), while
:class:`OneBitVote` and :class:`KbitVote` aggregate each rank's pre-sign update ``c`` and return
the direction every rank applies (±1, or a mean in [-1, 1]).

The sign votes (:attr:`VoteStages.votes_packed_signs`: the 1-bit vote, the k-bit vote of sign fields)
are also entered and left packed, so the optimizer can build the message in the same pass as Lion's
direction and apply the voted signs in the same pass as the update (the fused kernels of
:mod:`ds_lioncub.comm.packing`, docs/design.md section 5.1): :meth:`VoteStages.sign_message_layout`
says how to pack the message that :meth:`VoteStages.issue` sends, and
:meth:`VoteStages.complete_packed` gives the voted signs packed, one bit per element, instead of
unpacked to ±1. ``start`` is ``issue(pack(bucket))`` with the packing done here.

Every aggregation owns its state (:class:`AggregationState`, :mod:`ds_lioncub.aggregation.state`: its knobs,
per-bucket state, counters;
``state_dict()``/``load_state_dict()``) and answers for itself what callers would otherwise find out by
checking its type or re-deriving its layout: :attr:`~Aggregator.votes_packed_signs`,
:attr:`~Aggregator.votes_during_backward` (overlap) and :meth:`~Aggregator.tied_counts` (telemetry).
:class:`ExactMean` answers no and refuses the vote-only calls.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ds_lioncub.aggregation.state import AggregationState, Bucket
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.votes import PendingAggregate, PendingResult, finish_aggregate, voted_signs_packed


class Aggregator(Protocol):
    """The stages every aggregation offers (see the module docstring)."""

    #: The ranks it aggregates over.
    transport: Transport
    #: True when the aggregation averages gradients (exact Lion), False when it votes on ``c``.
    reduces_gradients: bool
    #: True when :class:`Bucket` needs ``piece_mean_abs`` for pieces cut from larger tensors.
    needs_whole_tensor_mean_abs: bool

    @property
    def state(self) -> AggregationState:
        """What it keeps across steps (see :class:`AggregationState`)."""
        ...

    def start(self, bucket: Bucket, positive_ties: bool) -> object: ...

    @property
    def agrees_before_start(self) -> bool:
        """Whether :meth:`agree` issues a collective of its own before :meth:`start` can pack (EF21's shared
        scale). ``start`` then runs ``agree`` itself if the caller did not: a caller that drives several
        ranks in one process (the virtual world) calls ``agree`` on every rank first."""
        ...

    def agree(self, bucket: Bucket) -> None:
        """Issue what ``start`` must know of the other ranks first, taking from ``bucket.values`` what it
        needs (a no-op where :attr:`agrees_before_start` is False)."""
        ...

    def reduce(self, pending: object) -> object: ...

    def complete(self, result: object, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor: ...

    # The questions a caller asks instead of checking the aggregation's type:

    @property
    def votes_packed_signs(self) -> bool:
        """Whether it is a vote of sign fields, whose message and result the caller may keep packed
        (:meth:`sign_message_layout`, :meth:`issue`, :meth:`complete_packed`)."""
        ...

    @property
    def votes_during_backward(self) -> bool:
        """Whether it can serve ``overlap`` (votes started from the gradient hooks, checked against the
        final gradients): a vote, whose message :meth:`pack` gives and :meth:`issue` sends."""
        ...

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor: ...

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate: ...

    def sign_message_layout(self, numel: int) -> tuple[int, int]: ...

    def complete_packed(self, result: object) -> torch.Tensor: ...

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]: ...


class VoteStages:
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

    @property
    def votes_during_backward(self) -> bool:
        """Every vote can serve ``overlap``: its message is :meth:`pack`'s, sent by :meth:`issue`."""
        return True

    @property
    def agrees_before_start(self) -> bool:
        """No collective before the message (error feedback's EF21 says otherwise)."""
        return False

    def agree(self, bucket: Bucket) -> None:
        """Nothing to agree before ``start``."""

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        """The positions of ``pending`` (what ``start``/``issue`` returned, its vote complete) whose summed
        vote is 0, as an int64 count of one element, and whether the count is an owner's share.

        A sum of 0 is exactly a position whose vote the tie rule decides. The 1-bit vote and the k-bit
        all-to-all leave each rank the p rows of its own chunk (its counts add up over the group to
        the bucket's: an owner's share); the k-bit all-reduce leaves every rank all the summed fields
        (its count is already the bucket's). Padding never ties.
        """
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
