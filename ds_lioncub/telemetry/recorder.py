"""The optimizer's recorder of its steps (:class:`StepTelemetry`): an observer of the events a rank's step emits
(:class:`~ds_lioncub.step.events.StepEvents`), which it turns into one :class:`StepRecord` per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.packing import pack_signs
from ds_lioncub.comm.transport import CommStats, Transport
from ds_lioncub.comm.votes import PendingAggregate, count_set_bits
from ds_lioncub.step.events import StepEnded
from ds_lioncub.step.noise_scale import NoiseScale
from ds_lioncub.telemetry.records import StepRecord, TelemetryTotals
from ds_lioncub.telemetry.vote_counts import VoteCounts, add_count, count_tied_votes


@dataclass
class StepTelemetry:
    """The optimizer's per-step records: the last one, and totals over all of them.

    It subscribes to the rank's step (:class:`~ds_lioncub.step.events.StepEvents`): :meth:`step_started` begins
    a record, each bucket's :meth:`bucket_done` adds its local seconds and voted elements, with ``vote_stats``
    this rank's signs (:meth:`local_signs`) are counted against the applied direction (:meth:`applied`),
    :meth:`revoted_bucket` counts a bucket voted again, and :meth:`step_ended` closes the record. The
    DeepSpeed integration brackets each engine step with :meth:`hold` and
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
    _signs: dict[int, torch.Tensor] = field(default_factory=dict)
    _pending: dict[int, object] = field(default_factory=dict)

    # ------------------------------------------------------------------ the step's events

    @property
    def wants_signs(self) -> bool:
        """This rank's signs are counted against the applied direction (option ``telemetry.vote_stats``)."""
        return self.vote_stats

    def step_started(self, traffic: CommStats) -> None:
        self.begin_step(traffic)

    def bucket_starting(self, k: int) -> None:
        pass

    def local_signs(self, k: int, signs: torch.Tensor) -> None:
        self._signs[k] = signs

    def issued(self, k: int, pending: object) -> None:
        if k in self._signs:  # kept only for a vote that is counted
            self._pending[k] = pending

    def wants_applied(self, k: int) -> bool:
        return k in self._signs

    def applied(self, k: int, aggregator: Aggregator, direction: torch.Tensor) -> None:
        self.count_vote(aggregator, self._pending.pop(k), self._signs.pop(k), direction)

    def bucket_done(self, k: int, voted_elements: int, local_seconds: float) -> None:
        self.add_bucket(local_seconds, voted_elements)

    def revoted_bucket(self) -> None:
        self.note_revoted_bucket()

    def step_ended(self, ended: StepEnded) -> None:
        aggregation = ended.aggregator
        if aggregation is not None:  # error feedback's ratio (one host sync), None without
            self.note_feedback(aggregation.state.feedback_kind, aggregation.state.take_feedback_ratio())
        self.note_noise_scale(ended.noise_scale)
        self.close_step(ended.step, ended.transport, ended.comm_stats)

    # ------------------------------------------------------------------ the records

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
        self._signs.clear()
        self._pending.clear()

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
