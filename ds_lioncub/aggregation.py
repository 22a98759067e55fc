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
(:mod:`ds_lioncub.step_paths`) keeps it so. The three kinds differ in what they
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

Every aggregation owns its state (:class:`AggregationState`, :mod:`ds_lioncub.aggregation_state`: its knobs,
per-bucket state, counters;
``state_dict()``/``load_state_dict()``) and answers for itself what callers would otherwise find out by
checking its type or re-deriving its layout: :attr:`~Aggregator.votes_packed_signs`,
:attr:`~Aggregator.votes_during_backward` (overlap) and :meth:`~Aggregator.tied_counts` (telemetry).
:class:`ExactMean` answers no and refuses the vote-only calls.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from ds_lioncub.aggregation_state import (
    AggregationState,
    Bucket,
    BucketKey,
    ExactMeanState,
    KbitVoteState,
    OneBitVoteState,
)
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.quantize import l1_segment_scales
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind
from ds_lioncub.comm.votes import (
    PendingAggregate,
    PendingResult,
    count_tied_kbit_sums,
    count_tied_sign_votes,
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


class ExactMean:
    """The mean of the ranks' tensors: one all-reduce per bucket in ``comm_dtype``, rounded back to fp32.

    Exact Lion averages gradients with it; momentum sync averages momenta. The sum runs in rank
    order (see :mod:`ds_lioncub.comm.transport`), so every rank gets the same bits.

    Tuning: see :class:`ExactMeanState` (``comm_dtype``). It takes no vote, so it answers no for packed
    signs and for overlap, and refuses the vote-only calls (:meth:`pack`, :meth:`issue`,
    :meth:`sign_message_layout`, :meth:`complete_packed`, :meth:`tied_counts`).
    """

    reduces_gradients = True
    needs_whole_tensor_mean_abs = False

    def __init__(self, transport: Transport, comm_dtype: torch.dtype = torch.float32) -> None:
        self.transport = transport
        self.state = ExactMeanState(comm_dtype)

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.state.comm_dtype

    def start(self, bucket: Bucket, positive_ties: bool = True) -> torch.Tensor:
        """The rank-order sum of the bucket in ``comm_dtype`` (no ties: nothing is signed), run to the end:
        its reduction is local work between two collectives."""
        self.state.issued += 1
        return self.transport.all_reduce_sum(bucket.values.to(self.comm_dtype))

    @property
    def votes_packed_signs(self) -> bool:
        return False

    @property
    def votes_during_backward(self) -> bool:
        return False

    @property
    def agrees_before_start(self) -> bool:
        return False

    def agree(self, bucket: Bucket) -> None:
        """Nothing to agree: the mean is one all-reduce."""

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        raise self._no_vote("pack")

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        raise self._no_vote("issue")

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        raise self._no_vote("sign_message_layout")

    def complete_packed(self, result: object) -> torch.Tensor:
        raise self._no_vote("complete_packed")

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        raise TypeError(f"count_tied_votes: {type(self).__name__} takes no vote")

    def _no_vote(self, call: str) -> ValueError:
        return ValueError(f"{call} is for votes, not {self!r}")

    def __repr__(self) -> str:
        return f"ExactMean(comm_dtype={self.comm_dtype})"

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


class KbitVote(_VoteStages):
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
        """The message ``start`` would send for ``bucket``: its packed b-bit fields."""
        sizes, scales = None, None
        if self.codec.quantizer == "l1":
            means = piece_means(bucket)
            sizes, scales = l1_segment_scales(bucket.values, self.codec.levels, self.l1_clip, bucket.piece_sizes, means)
        return pack_kbit_message(self.codec, bucket.values, positive_ties, scales, sizes)

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


def packed_sign_vote(aggregator: Aggregator) -> Vote | None:
    """``aggregator`` when it is a vote of sign fields (1-bit vote, k-bit vote of signs), else None.

    .. deprecated:: ask the aggregation instead: ``aggregator.votes_packed_signs``.
    """
    warnings.warn(
        "packed_sign_vote(aggregator) is deprecated: ask aggregator.votes_packed_signs",
        DeprecationWarning,
        stacklevel=2,
    )
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
    if options.error_feedback is not None:
        from ds_lioncub.error_feedback import build_error_feedback  # noqa: PLC0415 - it builds on KbitVote

        return build_error_feedback(transport, codec, options.aggregation, options.l1_clip, options.error_feedback)
    return KbitVote(transport, codec, options.aggregation, options.l1_clip)


Vote = OneBitVote | KbitVote

__all__ = [
    "COMM_DTYPES",
    "AggregationState",
    "Aggregator",
    "Bucket",
    "BucketKey",
    "ExactMean",
    "ExactMeanState",
    "KbitVote",
    "KbitVoteState",
    "OneBitVote",
    "OneBitVoteState",
    "Vote",
    "build_aggregation",
    "packed_sign_vote",
]
