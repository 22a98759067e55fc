"""What LionCub did in each optimizer step: bytes, collectives, seconds, and (opt-in) how the vote went.

:class:`StepTelemetry` is owned by the optimizer. Every step it takes the difference of
``LionCub.comm_stats()`` across the step (collectives, bytes and seconds inside the transports'
collectives, section 12 of docs/design.md for the bytes), adds the seconds spent in the
aggregations' local work, and closes a :class:`StepRecord`. A step that DeepSpeed skips (a
mixed-precision overflow: LionCub's ``step`` never runs) is closed by the integration with
:meth:`StepTelemetry.record_skipped_step`. With ``telemetry.vote_stats`` it also counts, per step,
the tied votes and the elements where this rank's own sign agreed with the applied one
(docs/design.md, section 18).

The monitor names (:meth:`StepRecord.monitor_events`) are defined here, so the DeepSpeed
integration and the documentation have one list to follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_lioncub.aggregation import Aggregator, KbitVote, OneBitVote
from ds_lioncub.comm.packing import pack_signs, sum_fields_per_position, unpack_fields, vote_packed_signs
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.comm.votes import PendingAggregate
from ds_lioncub.comm.wire import vote_padded_numel

#: The prefix of every monitor event LionCub writes.
MONITOR_PREFIX = "LionCub"


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one rank.

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
            counting, voting and unpacking of every bucket, collectives excluded (s).
        buckets: buckets aggregated in the step (count; 0 when nothing is aggregated, e.g. compression
            "none" under DeepSpeed).
        revoted_buckets: buckets whose vote was taken a second time in the step (count).
        tie_rate: with ``telemetry.vote_stats``: the fraction of the step's voted elements whose
            summed vote (the sum of the ranks' ±1 or L1 levels q) is exactly 0, over the group that
            votes (a fraction in [0, 1]); None otherwise.
        agreement_rate: with ``telemetry.vote_stats``: the fraction of the step's voted elements where
            this rank's sign of its pre-sign update c (zeros by the tie rule) equals the applied sign
            (for "mean": the sign of the applied value, 0 by the tie rule) (a fraction in [0, 1]);
            None otherwise.
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
    tie_rate: float | None
    agreement_rate: float | None

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
        return [(f"{MONITOR_PREFIX}/{name}", value) for name, value in events]


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
        elements: elements voted on.
    """

    tied_on_owners: torch.Tensor | None = None
    tied_everywhere: torch.Tensor | None = None
    agreeing: torch.Tensor | None = None
    elements: int = 0


def _add_count(total: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """``total + count`` as a one-element int64 tensor (one element: the step's all-reduce sums it in place)."""
    count = count.to(torch.int64).reshape(1)
    return count if total is None else total + count


# Set bits of each byte value: a popcount as one histogram of the bytes (bincount, on any device).
_SET_BITS_PER_BYTE = torch.tensor([bin(value).count("1") for value in range(256)], dtype=torch.int64)


def count_set_bits(packed: torch.Tensor) -> torch.Tensor:
    """The number of 1 bits in a uint8 tensor (int64, one element), in one pass over its bytes."""
    histogram = torch.bincount(packed.reshape(-1), minlength=256)
    return (histogram * _SET_BITS_PER_BYTE.to(histogram.device)).sum()


def pack_local_signs(values: torch.Tensor, positive_ties: bool) -> torch.Tensor:
    """This rank's resolved signs of a bucket, packed (docs/design.md, section 5: 1 means +1)."""
    return pack_signs(values, positive_ties)


def count_tied_votes(aggregator: Aggregator, pending: PendingAggregate) -> tuple[torch.Tensor, bool]:
    """The positions of ``pending`` whose summed vote is 0, and whether the count is an owner's share.

    A sum of 0 is exactly a position whose vote the tie rule decides, so it is counted as such: the
    1-bit vote where the votes with positive and with negative ties differ, the k-bit sums where
    ``f`` lies in ``[T(+), T(-))`` (section 4.6's thresholds; empty for sign fields at odd p).
    The 1-bit vote and the k-bit all-to-all leave each rank the p rows of its own chunk (its counts
    add up over the group to the bucket's); the k-bit all-reduce leaves every rank all the summed
    fields (its count is already the bucket's). Padding never ties: its sums are 0, below T(+).
    """
    if isinstance(aggregator, OneBitVote):
        world_size = aggregator.transport.world_size
        chunk_numel = vote_padded_numel(pending.numel, world_size) // world_size
        with_positive = vote_packed_signs(pending.received, chunk_numel, True)
        with_negative = vote_packed_signs(pending.received, chunk_numel, False)
        return count_set_bits(torch.bitwise_xor(with_positive, with_negative)), True
    if isinstance(aggregator, KbitVote):
        codec = aggregator.codec
        if codec.algorithm == "allreduce":
            sums = unpack_fields(pending.received, codec.bits, pending.numel)
            on_owner = False
        else:
            chunk_numel = vote_padded_numel(pending.numel, codec.world_size) // codec.world_size
            sums = sum_fields_per_position(pending.received, codec.bits, chunk_numel)
            on_owner = True
        low, high = codec.vote_threshold(True), codec.vote_threshold(False)
        histogram = torch.bincount(sums.reshape(-1), minlength=high)
        return histogram[low:high].sum(), on_owner
    raise TypeError(f"count_tied_votes: {type(aggregator).__name__} takes no vote")


@dataclass
class StepTelemetry:
    """The optimizer's per-step records: the last one, and totals over all of them.

    The optimizer calls :meth:`begin_step`, :meth:`add_local_seconds` per aggregated bucket,
    :meth:`count_vote` per bucket when ``vote_stats`` is on, and :meth:`end_step`. A mode that takes
    a bucket's vote again in the same step increments :attr:`revoted_buckets` (via
    :meth:`note_revoted_bucket`), so the record shows it.
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

    def begin_step(self, comm: CommStats) -> None:
        """Start a step whose traffic so far is ``comm`` (a copy of ``comm_stats()``)."""
        self._baseline = comm
        self._local_seconds = 0.0
        self._buckets = 0
        self.revoted_buckets = 0
        self._votes = VoteCounts()

    def add_local_seconds(self, seconds: float) -> None:
        """One bucket's aggregation work, its collectives' seconds already taken out."""
        self._local_seconds += seconds
        self._buckets += 1

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
        votes.elements += applied.numel()

    def owner_tie_counts(self) -> torch.Tensor | None:
        """The step's owner-side tie count (int64, one element), to be summed over the group in place
        before :meth:`end_step`; None when the step counted none."""
        return self._votes.tied_on_owners

    def end_step(self, step: int, comm: CommStats) -> StepRecord:
        """Close step ``step`` with the traffic now ``comm``; owner tie counts must be summed by then."""
        delta = comm - self._baseline
        tie_rate, agreement_rate = self._rates()
        return self._keep(
            StepRecord(
                step=step,
                skipped=False,
                collectives=delta.collectives,
                bytes_sent=delta.bytes_sent,
                bytes_received=delta.bytes_received,
                comm_seconds=delta.seconds,
                local_seconds=self._local_seconds,
                buckets=self._buckets,
                revoted_buckets=self.revoted_buckets,
                tie_rate=tie_rate,
                agreement_rate=agreement_rate,
            )
        )

    def record_skipped_step(self, step: int) -> StepRecord:
        """A step DeepSpeed skipped (LionCub did not run); ``step`` is the step count that stayed."""
        return self._keep(StepRecord(step, True, 0, 0, 0, 0.0, 0.0, 0, 0, None, None))

    def _rates(self) -> tuple[float | None, float | None]:
        votes = self._votes
        if not self.vote_stats or votes.elements == 0 or votes.agreeing is None:
            return None, None
        tied = sum(int(count.item()) for count in (votes.tied_on_owners, votes.tied_everywhere) if count is not None)
        return tied / votes.elements, int(votes.agreeing.item()) / votes.elements

    def _keep(self, record: StepRecord) -> StepRecord:
        self.last = record
        self.totals.add(record)
        return record


__all__ = [
    "MONITOR_PREFIX",
    "StepRecord",
    "StepTelemetry",
    "TelemetryTotals",
    "VoteCounts",
    "count_set_bits",
    "count_tied_votes",
    "pack_local_signs",
]
