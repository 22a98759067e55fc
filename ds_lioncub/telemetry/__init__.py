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

The package: :mod:`.records` the records, their totals and their monitor events (the monitor names, one list
for the DeepSpeed integration and the documentation); :mod:`.vote_counts` the counting of a step's votes;
:mod:`.recorder` :class:`StepTelemetry`, the observer of a rank's step (:mod:`ds_lioncub.step.events`). Every
name imports from here.
"""

from __future__ import annotations

from ds_lioncub.comm.votes import count_set_bits
from ds_lioncub.telemetry.recorder import StepTelemetry
from ds_lioncub.telemetry.records import FEEDBACK_EVENTS, MONITOR_PREFIX, StepRecord, TelemetryTotals
from ds_lioncub.telemetry.vote_counts import VoteCounts, count_tied_votes, pack_local_signs

__all__ = [
    "FEEDBACK_EVENTS",
    "MONITOR_PREFIX",
    "StepRecord",
    "StepTelemetry",
    "TelemetryTotals",
    "VoteCounts",
    "count_set_bits",
    "count_tied_votes",
    "pack_local_signs",
]
