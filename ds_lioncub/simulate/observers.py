"""What the virtual world watches of its workers' steps: the applied update against exact Lion's (agreement, drift).

Each virtual worker's step (:class:`~ds_lioncub.step.rank_step.RankStep`) reports to a :class:`WorkerEvents`
(:mod:`ds_lioncub.step.events`); all of them feed one :class:`StepComparison` per step, which sees every worker's
momentum and gradient, and so exact Lion's direction (:func:`~ds_lioncub.simulate.agreement.summed_directions`),
taken when worker 0 starts a bucket, before any worker's momentum of it changes. Worker 0, which applies the
update, hands over the direction applied; the others, their votes' pending collectives (their tie counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.simulate.agreement import AgreementTally, summed_directions
from ds_lioncub.simulate.drift import DriftTally
from ds_lioncub.step.bucket_plan import Piece
from ds_lioncub.step.bucket_work import Entry
from ds_lioncub.step.events import NoEvents


@dataclass
class StepComparison:
    """One step's buckets compared with exact Lion: the agreement tally (None: not kept) and the drift (None), over
    every worker's ``entries`` and the step's bucket ``plan``; ``labels`` name the tensors in the drift."""

    entries: list[list[Entry]]
    plan: list[list[Piece]]
    aggregators: list[Aggregator]
    tally: AgreementTally | None
    drift: DriftTally | None
    labels: list[str] | None
    #: Exact Lion's summed direction of each bucket started, until it is applied.
    exact: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Each started bucket's pending votes, one per worker in worker order.
    pending: dict[int, list[object]] = field(default_factory=dict)

    def bucket_starting(self, k: int) -> None:
        """Exact Lion's direction of bucket ``k`` (summed), before any worker's momentum of it changes."""
        self.exact[k] = summed_directions(self.entries, self.plan[k])
        self.pending[k] = []

    def applied(self, k: int, direction: torch.Tensor) -> None:
        """Bucket ``k``'s update as applied, against exact Lion's direction."""
        exact = self.exact.pop(k)
        pending = self.pending.pop(k)
        if self.tally is not None:
            self.tally.add(exact, direction, self.aggregators, pending)
        if self.drift is not None and self.labels is not None:
            bucket = self.plan[k]
            numels = [self.entries[0][piece.tensor_index].param.numel() for piece in bucket]
            names = [self.labels[piece.tensor_index] for piece in bucket]
            self.drift.add_bucket(bucket, names, numels, exact, direction)


class WorkerEvents(NoEvents):
    """Worker ``worker``'s events, fed into the step's :class:`StepComparison` (set by :meth:`compare`)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.comparison: StepComparison | None = None

    def compare(self, comparison: StepComparison | None) -> None:
        self.comparison = comparison

    def bucket_starting(self, k: int) -> None:
        if self.comparison is not None and self.worker == 0:
            self.comparison.bucket_starting(k)

    def issued(self, k: int, pending: object) -> None:
        if self.comparison is not None:
            self.comparison.pending[k].append(pending)

    def wants_applied(self, k: int) -> bool:
        return self.comparison is not None and self.worker == 0

    def applied(self, k: int, aggregator: Aggregator, direction: torch.Tensor) -> None:
        assert self.comparison is not None
        self.comparison.applied(k, direction)


__all__ = ["StepComparison", "WorkerEvents"]
