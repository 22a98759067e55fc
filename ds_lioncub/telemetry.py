"""What LionCub did in each optimizer step: bytes, collectives, seconds, and (opt-in) how the vote went.

:class:`StepTelemetry` is owned by the optimizer. Every step it takes the difference of
``LionCub.comm_stats()`` across the step (collectives, bytes and seconds inside the transports'
collectives, section 14 of docs/design.md for the bytes), adds the seconds spent in the
aggregations' local work, and closes a :class:`StepRecord`. Under DeepSpeed the integration brackets
each engine step with :meth:`StepTelemetry.hold` and :meth:`StepTelemetry.release`: one record for
however many ``step`` calls the engine made (one per param group under ZeRO; none when it skipped the
step on a mixed-precision overflow, which the record then says). With ``telemetry.vote_stats`` it also
counts, per step, the tied votes and the elements where this rank's own sign agreed with the applied
one (docs/design.md, section 15).

The monitor names (:meth:`StepRecord.monitor_events`) are defined here, so the DeepSpeed
integration and the documentation have one list to follow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.packing import pack_signs
from ds_lioncub.comm.transport import CommStats, Transport
from ds_lioncub.comm.votes import PendingAggregate, count_set_bits
from ds_lioncub.step.noise_scale import NoiseScale

#: The prefix of every monitor event LionCub writes.
MONITOR_PREFIX = "LionCub"
#: The monitor event of each error-feedback form's ratio (:attr:`StepRecord.feedback_ratio`), under MONITOR_PREFIX.
FEEDBACK_EVENTS = {"residual": "ef_residual_ratio", "ef21": "ef21_estimate_gap"}


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one rank (under DeepSpeed: one engine step, whatever the ``step`` calls).

    Attributes:
        step: the optimizer step t (1-based) the record describes; for a skipped step, the step
            count that stayed (the last step taken).
        skipped: True when DeepSpeed skipped the step (fp16/bf16 overflow) and LionCub did not run;
            every count below is then 0 and the rates are None.
        collectives: collectives this rank issued in the step (count).
        bytes_sent: payload bytes this rank sent in the step (bytes; the counts of
            :mod:`ds_lioncub.comm.wire`, equal to the difference of ``comm_stats()`` across the step).
        bytes_received: payload bytes this rank received in the step (bytes).
        comm_seconds: host wall-clock seconds inside the transports' collectives (s).
        local_seconds: host wall-clock seconds in the aggregations' own work, i.e. packing,
            counting, voting and unpacking of every bucket, collectives excluded (s). The sign votes
            pack and unpack in the same passes as Lion's direction and update (the fused step,
            docs/design.md section 5.1); those passes count whole.
        buckets: buckets aggregated in the step (count; 0 when nothing is aggregated, e.g. compression
            "none" under DeepSpeed).
        revoted_buckets: buckets whose vote was taken a second time in the step (count).
        voted_elements: elements whose direction was voted on (count; this rank's shard under the ZeRO
            hybrid).
        tied_elements: with ``telemetry.vote_stats``: voted elements whose summed vote (the sum of the
            ranks' ±1 or L1 levels q) is exactly 0, over the group that votes (count); None otherwise.
        agreeing_elements: with ``telemetry.vote_stats``: voted elements where this rank's sign of its
            pre-sign update c (zeros by the tie rule) equals the sign of the applied direction (0 by
            the tie rule) (count); None otherwise.
        feedback_kind: the error feedback of the step ("residual", "ef21"); None without.
        feedback_ratio: with error feedback, this rank's ``||fed back|| / ||c||`` over the step's buckets
            (a ratio): the residual e after the step (residual form), or ``c - G_i`` after the update, the
            part of its own update its estimate still misses (EF21: the proxy of ``|G - mean c|`` a rank
            can compute); None without.
        noise_scale: with ``telemetry.noise_scale``: the smoothed gradient noise scale B_simple after this step, in
            samples (:attr:`ds_lioncub.LionCub.noise_scale`); None when not measured or the samples per voter
            batch are not known (plain Python, until ``set_noise_scale_batch``).
        noise_scale_voter_batches: the same in voter batches (a voter's gradient's batch); None when not measured.
    """

    step: int
    skipped: bool
    collectives: int
    bytes_sent: int
    bytes_received: int
    comm_seconds: float
    local_seconds: float
    buckets: int
    revoted_buckets: int
    voted_elements: int
    tied_elements: int | None
    agreeing_elements: int | None
    feedback_kind: str | None = None
    feedback_ratio: float | None = None
    noise_scale: float | None = None
    noise_scale_voter_batches: float | None = None

    @property
    def tie_rate(self) -> float | None:
        """``tied_elements / voted_elements`` (a fraction in [0, 1]); None when not measured."""
        if self.tied_elements is None or self.voted_elements == 0:
            return None
        return self.tied_elements / self.voted_elements

    @property
    def agreement_rate(self) -> float | None:
        """``agreeing_elements / voted_elements`` (a fraction in [0, 1]); None when not measured."""
        if self.agreeing_elements is None or self.voted_elements == 0:
            return None
        return self.agreeing_elements / self.voted_elements

    def monitor_events(self) -> list[tuple[str, float]]:
        """``(name, value)`` pairs under ``LionCub/``, for ``engine.monitor.write_events``.

        The rates appear only when measured: a monitor has no "missing" value.
        """
        events: list[tuple[str, float]] = [
            ("bytes_sent", self.bytes_sent),
            ("bytes_received", self.bytes_received),
            ("collectives", self.collectives),
            ("comm_seconds", self.comm_seconds),
            ("local_seconds", self.local_seconds),
            ("skipped", int(self.skipped)),
            ("revoted_buckets", self.revoted_buckets),
        ]
        if self.tie_rate is not None:
            events.append(("tie_rate", self.tie_rate))
        if self.agreement_rate is not None:
            events.append(("agreement_rate", self.agreement_rate))
        if self.feedback_ratio is not None:
            events.append((FEEDBACK_EVENTS.get(self.feedback_kind or "", "feedback_ratio"), self.feedback_ratio))
        if self.noise_scale is not None:
            events.append(("noise_scale", self.noise_scale))
        if self.noise_scale_voter_batches is not None:
            events.append(("noise_scale_voter_batches", self.noise_scale_voter_batches))
        return [(f"{MONITOR_PREFIX}/{name}", value) for name, value in events]

    @classmethod
    def skipped_step(cls, step: int, comm: CommStats | None = None) -> StepRecord:
        """A step DeepSpeed skipped: LionCub did not run; ``step`` is the step count that stayed. ``comm``: what
        LionCub sent for it before the skip was decided (option clip's all-reduce under ZeRO), else nothing."""
        sent = CommStats() if comm is None else comm
        return cls(
            step, True, sent.collectives, sent.bytes_sent, sent.bytes_received, sent.seconds, 0.0, 0, 0, 0, None, None
        )

    @classmethod
    def combined(cls, records: list[StepRecord]) -> StepRecord:
        """One record for several ``step`` calls of one optimizer step (ZeRO steps each param group
        apart): counts and seconds added, the last call's step number."""
        tied = [r.tied_elements for r in records]
        agreeing = [r.agreeing_elements for r in records]
        return cls(
            step=records[-1].step,
            skipped=False,
            collectives=sum(r.collectives for r in records),
            bytes_sent=sum(r.bytes_sent for r in records),
            bytes_received=sum(r.bytes_received for r in records),
            comm_seconds=sum(r.comm_seconds for r in records),
            local_seconds=sum(r.local_seconds for r in records),
            buckets=sum(r.buckets for r in records),
            revoted_buckets=sum(r.revoted_buckets for r in records),
            voted_elements=sum(r.voted_elements for r in records),
            tied_elements=None if None in tied else sum(t for t in tied if t is not None),
            agreeing_elements=None if None in agreeing else sum(a for a in agreeing if a is not None),
            feedback_kind=next((r.feedback_kind for r in reversed(records) if r.feedback_ratio is not None), None),
            feedback_ratio=next((r.feedback_ratio for r in reversed(records) if r.feedback_ratio is not None), None),
            noise_scale=next((r.noise_scale for r in reversed(records) if r.noise_scale is not None), None),
            noise_scale_voter_batches=next(
                (r.noise_scale_voter_batches for r in reversed(records) if r.noise_scale_voter_batches is not None),
                None,
            ),
        )


@dataclass
class TelemetryTotals:
    """Sums over every step recorded since the optimizer was built (units as in :class:`StepRecord`).

    Attributes:
        steps: steps recorded, skipped ones included (count).
        skipped_steps: steps DeepSpeed skipped (count).
        collectives, bytes_sent, bytes_received: summed over the steps (count, bytes, bytes).
        comm_seconds, local_seconds: summed over the steps (s).
        revoted_buckets: summed over the steps (count).
    """

    steps: int = 0
    skipped_steps: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    comm_seconds: float = 0.0
    local_seconds: float = 0.0
    revoted_buckets: int = 0

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.skipped_steps += int(record.skipped)
        self.collectives += record.collectives
        self.bytes_sent += record.bytes_sent
        self.bytes_received += record.bytes_received
        self.comm_seconds += record.comm_seconds
        self.local_seconds += record.local_seconds
        self.revoted_buckets += record.revoted_buckets


@dataclass
class VoteCounts:
    """One step's vote statistics, kept as device tensors until the step ends (one host sync then).

    Attributes:
        tied_on_owners: tied positions this rank counted as the owner of a chunk; they add up over
            the group (the 1-bit vote, the k-bit all-to-all).
        tied_everywhere: tied positions of sums every rank holds whole (the k-bit all-reduce); not
            summed over the group.
        agreeing: elements where this rank's sign equals the applied sign.
        elements: elements voted on (counted with or without ``vote_stats``).
    """

    tied_on_owners: torch.Tensor | None = None
    tied_everywhere: torch.Tensor | None = None
    agreeing: torch.Tensor | None = None
    elements: int = 0


def _add_count(total: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """``total + count`` as a one-element int64 tensor (one element: the step's all-reduce sums it in place)."""
    count = count.to(torch.int64).reshape(1)
    return count if total is None else total + count


def pack_local_signs(values: torch.Tensor, positive_ties: bool) -> torch.Tensor:
    """This rank's resolved signs of a bucket, packed (docs/design.md, section 5: 1 means +1)."""
    return pack_signs(values, positive_ties)


def count_tied_votes(aggregator: Aggregator, pending: PendingAggregate) -> tuple[torch.Tensor, bool]:
    """The positions of ``pending`` whose summed vote is 0, and whether the count is an owner's share:
    the aggregation's own :meth:`~ds_lioncub.aggregation.Aggregator.tied_counts` (which knows its chunk
    layout and thresholds). Raises TypeError for an aggregation that takes no vote."""
    return aggregator.tied_counts(pending)


@dataclass
class StepTelemetry:
    """The optimizer's per-step records: the last one, and totals over all of them.

    The optimizer calls :meth:`begin_step` and, at the end, :meth:`close_step`; in between the step
    paths observe their buckets through a :class:`BucketWatch` (:meth:`watch`), which calls
    :meth:`add_bucket` per aggregated bucket, :meth:`count_vote` per bucket when ``vote_stats`` is on,
    and :meth:`note_revoted_bucket` when a bucket's vote is taken again in the same step, so the
    record shows it. The DeepSpeed integration brackets each engine step with :meth:`hold` and
    :meth:`release`, which make one record of however many ``step`` calls it took (none: a skipped
    step; one per param group under ZeRO).
    """

    vote_stats: bool = False
    last: StepRecord | None = None
    totals: TelemetryTotals = field(default_factory=TelemetryTotals)
    #: Buckets voted a second time in the current step.
    revoted_buckets: int = 0
    _baseline: CommStats = field(default_factory=CommStats)
    _local_seconds: float = 0.0
    _buckets: int = 0
    _votes: VoteCounts = field(default_factory=VoteCounts)
    _held: list[StepRecord] | None = None
    _feedback: tuple[str | None, float | None] = (None, None)
    _noise_scale: NoiseScale | None = None

    def hold(self) -> None:
        """Keep the records of the following ``step`` calls apart until :meth:`release` (or :meth:`drop_held`)."""
        self._held = []

    def release(self, step: int, before_step: CommStats | None = None) -> StepRecord:
        """One record for the ``step`` calls since :meth:`hold`: their sum, or a skipped step at ``step``
        (the step count that stayed) when there was none, with the traffic ``before_step`` sent for it."""
        held, self._held = self._held or [], None
        return self._keep(StepRecord.combined(held) if held else StepRecord.skipped_step(step, before_step))

    def drop_held(self) -> None:
        """Forget the records since :meth:`hold` (the engine step raised)."""
        self._held = None

    def begin_step(self, comm: CommStats) -> None:
        """Start a step whose traffic so far is ``comm`` (a copy of ``comm_stats()``)."""
        self._baseline = comm
        self._local_seconds = 0.0
        self._buckets = 0
        self.revoted_buckets = 0
        self._votes = VoteCounts()
        self._feedback = (None, None)
        self._noise_scale = None

    def note_feedback(self, kind: str | None, ratio: float | None) -> None:
        """The step's error-feedback ratio (:attr:`StepRecord.feedback_ratio`), of the aggregation's ``kind``."""
        self._feedback = (kind, ratio) if ratio is not None else (None, None)

    def note_noise_scale(self, noise_scale: NoiseScale | None) -> None:
        """The smoothed gradient noise scale after the step (:attr:`StepRecord.noise_scale`); None: not measured."""
        self._noise_scale = noise_scale

    def add_bucket(self, local_seconds: float, voted_elements: int) -> None:
        """One aggregated bucket: its local work's seconds (its collectives' taken out) and the elements it
        voted on (0 for an exact mean)."""
        self._local_seconds += local_seconds
        self._buckets += 1
        self._votes.elements += voted_elements

    def note_revoted_bucket(self) -> None:
        """A bucket of this step was voted on again."""
        self.revoted_buckets += 1

    def count_vote(
        self,
        aggregator: Aggregator,
        pending: object,
        local_signs: torch.Tensor,
        applied: torch.Tensor,
    ) -> None:
        """Add one bucket: its tied votes (from ``pending``, what ``aggregator.start`` returned), and where
        ``local_signs`` (:func:`pack_local_signs` of the bucket before the vote overwrote it) equals the
        sign of the ``applied`` direction (0 by the tie rule, as for the local signs)."""
        assert isinstance(pending, PendingAggregate)
        votes = self._votes
        tied, on_owner = count_tied_votes(aggregator, pending)
        if on_owner:
            votes.tied_on_owners = _add_count(votes.tied_on_owners, tied)
        else:
            votes.tied_everywhere = _add_count(votes.tied_everywhere, tied)
        # Both packed alike (padding bits 0): the differing bits are the disagreements.
        differing = count_set_bits(torch.bitwise_xor(local_signs, pack_signs(applied, pending.positive_ties)))
        votes.agreeing = _add_count(votes.agreeing, applied.numel() - differing)

    def watch(self, transport: Transport) -> BucketWatch:
        """The observer of one step path whose aggregation communicates over ``transport``."""
        return BucketWatch(self, transport)

    def close_step(self, step: int, transport: Transport, comm: Callable[[], CommStats]) -> StepRecord:
        """Sum the chunk owners' tie counts over ``transport``'s group (``vote_stats`` only), then close
        step ``step`` with the traffic ``comm()`` gives after that."""
        owner_ties = self.owner_tie_counts()
        if owner_ties is not None:
            # The telemetry's own 8-byte all-reduce is left out of the traffic counts, like the set-up
            # check: the counters describe the training's traffic.
            with transport.uncounted():
                transport.all_reduce_sum(owner_ties)
        return self.end_step(step, comm())

    def owner_tie_counts(self) -> torch.Tensor | None:
        """The step's owner-side tie count (int64, one element), to be summed over the group in place
        before :meth:`end_step`; None when the step counted none."""
        return self._votes.tied_on_owners

    def end_step(self, step: int, comm: CommStats) -> StepRecord:
        """Close step ``step`` with the traffic now ``comm``; owner tie counts must be summed by then."""
        delta = comm - self._baseline
        votes = self._votes
        measured = self.vote_stats and votes.agreeing is not None
        tied = [count for count in (votes.tied_on_owners, votes.tied_everywhere) if count is not None]
        record = StepRecord(
            step=step,
            skipped=False,
            collectives=delta.collectives,
            bytes_sent=delta.bytes_sent,
            bytes_received=delta.bytes_received,
            comm_seconds=delta.seconds,
            local_seconds=self._local_seconds,
            buckets=self._buckets,
            revoted_buckets=self.revoted_buckets,
            voted_elements=votes.elements,
            # One host sync per step, for the vote statistics only.
            tied_elements=sum(int(count.item()) for count in tied) if measured else None,
            agreeing_elements=int(votes.agreeing.item()) if measured and votes.agreeing is not None else None,
            feedback_kind=self._feedback[0],
            feedback_ratio=self._feedback[1],
            noise_scale=None if self._noise_scale is None else self._noise_scale.b_simple,
            noise_scale_voter_batches=None if self._noise_scale is None else self._noise_scale.b_simple_voter_batches,
        )
        if self._held is not None:
            self._held.append(record)
            return record
        return self._keep(record)

    def _keep(self, record: StepRecord) -> StepRecord:
        self.last = record
        self.totals.add(record)
        return record


_Result = TypeVar("_Result")


class BucketWatch:
    """What one step path's buckets tell :class:`StepTelemetry`, through one object.

    The path times each bucket's aggregation stages with :meth:`timed` (the transport's collectives
    taken out), hands over this rank's packed signs before the vote (:meth:`local_signs`, only when
    :attr:`wants_signs`) and the pending vote (:meth:`issued`), counts them against the applied
    direction (:meth:`voted`, where :meth:`counts`) and closes each bucket with :meth:`bucket_done`.
    """

    def __init__(self, telemetry: StepTelemetry, transport: Transport) -> None:
        self._telemetry = telemetry
        self._transport = transport
        #: Whether the step's vote statistics are counted (option ``telemetry.vote_stats``).
        self.wants_signs = telemetry.vote_stats
        self._seconds: dict[int, float] = {}
        self._signs: dict[int, torch.Tensor] = {}
        self._pending: dict[int, object] = {}

    def timed(self, k: int, stage: Callable[..., _Result], *args: Any) -> _Result:
        """``stage(*args)``, its local seconds (its collectives' taken out) added to bucket ``k``'s."""
        started, in_collectives = time.perf_counter(), self._transport.stats.seconds
        try:
            return stage(*args)
        finally:
            elapsed = time.perf_counter() - started - (self._transport.stats.seconds - in_collectives)
            self._seconds[k] = self._seconds.get(k, 0.0) + elapsed

    def local_signs(self, k: int, signs: torch.Tensor) -> None:
        """This rank's signs of bucket ``k`` (:func:`pack_local_signs`), taken before the vote."""
        self._signs[k] = signs

    def issued(self, k: int, pending: object) -> None:
        """Bucket ``k``'s first collective is out; kept until :meth:`voted` only if its signs are counted."""
        if k in self._signs:
            self._pending[k] = pending

    def counts(self, k: int) -> bool:
        """Whether bucket ``k``'s vote is counted (its local signs were handed over)."""
        return k in self._signs

    def voted(self, k: int, aggregator: Aggregator, applied: torch.Tensor) -> None:
        """Count bucket ``k``'s tied votes and agreeing signs against ``applied``; forget what was kept."""
        signs, pending = self._signs.pop(k), self._pending.pop(k)
        self._telemetry.count_vote(aggregator, pending, signs, applied)

    def bucket_done(self, k: int, voted_elements: int) -> None:
        """Bucket ``k`` is aggregated: record its local seconds and the elements it voted on."""
        self._telemetry.add_bucket(self._seconds.pop(k, 0.0), voted_elements)

    def revoted_bucket(self) -> None:
        """A bucket of this step was voted on again."""
        self._telemetry.note_revoted_bucket()


__all__ = [
    "MONITOR_PREFIX",
    "BucketWatch",
    "StepRecord",
    "StepTelemetry",
    "TelemetryTotals",
    "VoteCounts",
    "count_set_bits",
    "count_tied_votes",
    "pack_local_signs",
]
