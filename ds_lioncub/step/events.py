"""What a rank's step tells whoever watches it: the events its stages emit, and the clock of its local work.

The step calls no telemetry. Its stages emit the events of :class:`StepEvents` to one observer, which
:class:`~ds_lioncub.telemetry.StepTelemetry` is on LionCub's ranks (the per-step records) and the virtual
world's tallies are on its workers (agreement with exact Lion, drift); :data:`NO_EVENTS` listens to nothing. An
observer that wants something costly (this rank's signs before the vote, the applied direction unpacked) says
so, and the stages compute it only then.

:class:`StageClock` is the step's own measure of its local work per bucket: each stage's seconds with the
collectives' seconds taken out (the transport counts those), reported with :meth:`StepEvents.bucket_done`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.transport import CommStats, Transport
from ds_lioncub.step.noise_scale import NoiseScale


@dataclass(frozen=True)
class StepEnded:
    """What a rank's step says when it ends (:meth:`StepEvents.step_ended`).

    Attributes:
        step: the step taken.
        transport: the voters' group (an observer that sums its counts over the voters uses it).
        comm_stats: the rank's traffic so far (called after the observer's own collectives, if any).
        aggregator: the step's aggregation (None: none); error feedback's ratio is in its state.
        noise_scale: the smoothed gradient noise scale after the step (None: not measured).
    """

    step: int
    transport: Transport
    comm_stats: Callable[[], CommStats]
    aggregator: Aggregator | None
    noise_scale: NoiseScale | None


class StepEvents(Protocol):
    """The events a rank's step emits, in order: :meth:`step_started`, per bucket :meth:`bucket_starting`,
    :meth:`local_signs` (only where :attr:`wants_signs`), :meth:`issued`, :meth:`applied` (only where
    :meth:`wants_applied`) and :meth:`bucket_done`, :meth:`revoted_bucket` for a bucket voted again, then
    :meth:`step_ended`."""

    @property
    def wants_signs(self) -> bool:
        """Whether this rank's packed signs of each bucket are wanted before the vote (they cost a pass)."""

    def step_started(self, traffic: CommStats) -> None:
        """A step starts; ``traffic`` is the rank's traffic counted so far that is not this step's."""

    def bucket_starting(self, k: int) -> None:
        """Bucket ``k`` is about to be prepared (its momenta and gradients are still the step's inputs)."""

    def local_signs(self, k: int, signs: torch.Tensor) -> None:
        """This rank's packed signs of bucket ``k``, before the vote."""

    def issued(self, k: int, pending: object) -> None:
        """Bucket ``k``'s first collective is out (``pending``: what the aggregation's issue or start returned)."""

    def wants_applied(self, k: int) -> bool:
        """Whether bucket ``k``'s applied direction is wanted (unpacking a sign vote's result costs a pass)."""

    def applied(self, k: int, aggregator: Aggregator, direction: torch.Tensor) -> None:
        """Bucket ``k``'s direction as applied (fp32, unpacked), before it changes the parameters."""

    def bucket_done(self, k: int, voted_elements: int, local_seconds: float) -> None:
        """Bucket ``k`` is aggregated: the elements it voted on (0 for a mean) and its local work's seconds."""

    def revoted_bucket(self) -> None:
        """A bucket of this step was voted on again (an armed backward's message changed)."""

    def step_ended(self, ended: StepEnded) -> None:
        """The step is done (post-step hooks included)."""


class NoEvents:
    """The observer that listens to nothing."""

    wants_signs = False

    def step_started(self, traffic: CommStats) -> None:
        pass

    def bucket_starting(self, k: int) -> None:
        pass

    def local_signs(self, k: int, signs: torch.Tensor) -> None:
        pass

    def issued(self, k: int, pending: object) -> None:
        pass

    def wants_applied(self, k: int) -> bool:
        return False

    def applied(self, k: int, aggregator: Aggregator, direction: torch.Tensor) -> None:
        pass

    def bucket_done(self, k: int, voted_elements: int, local_seconds: float) -> None:
        pass

    def revoted_bucket(self) -> None:
        pass

    def step_ended(self, ended: StepEnded) -> None:
        pass


#: The observer of a step nobody watches.
NO_EVENTS = NoEvents()


class StageClock:
    """Each bucket's local seconds: the stages run inside :meth:`timing`, less the seconds ``transport`` spent in
    collectives meanwhile; :meth:`take` hands a bucket's total over once. A block, not a wrapper: the stage's own
    call stays in the step's code, where a reader follows it."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._seconds: dict[int, float] = {}

    @contextmanager
    def timing(self, k: int) -> Iterator[None]:
        """The block's local seconds, added to bucket ``k``'s."""
        started, in_collectives = time.perf_counter(), self._transport.stats.seconds
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started - (self._transport.stats.seconds - in_collectives)
            self._seconds[k] = self._seconds.get(k, 0.0) + elapsed

    def take(self, k: int) -> float:
        """Bucket ``k``'s local seconds so far, forgotten here."""
        return self._seconds.pop(k, 0.0)


__all__ = ["NO_EVENTS", "NoEvents", "StageClock", "StepEnded", "StepEvents"]
