"""The records of LionCub's steps: one step's (:class:`StepRecord`), the totals over all of them
(:class:`TelemetryTotals`), and the monitor events a record becomes (:meth:`StepRecord.monitor_events`).

The monitor names are defined here, so the DeepSpeed integration and the documentation have one list to follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_lioncub.comm.transport import CommStats

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
