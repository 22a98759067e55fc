"""The optimizer's recorder of its steps (:class:`StepTelemetry`) and what one step path's buckets tell it
(:class:`BucketWatch`)."""

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
from ds_lioncub.telemetry.records import StepRecord, TelemetryTotals
from ds_lioncub.telemetry.vote_counts import VoteCounts, add_count, count_tied_votes


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
            votes.tied_on_owners = add_count(votes.tied_on_owners, tied)
        else:
            votes.tied_everywhere = add_count(votes.tied_everywhere, tied)
        # Both packed alike (padding bits 0): the differing bits are the disagreements.
        differing = count_set_bits(torch.bitwise_xor(local_signs, pack_signs(applied, pending.positive_ties)))
        votes.agreeing = add_count(votes.agreeing, applied.numel() - differing)

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
