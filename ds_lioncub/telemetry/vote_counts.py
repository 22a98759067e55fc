"""Counting a step's votes (option ``telemetry.vote_stats``): the tied votes and the elements where this rank's
own sign agreed with the applied one (docs/design.md, section 15), kept as device tensors until the step ends."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.packing import pack_signs
from ds_lioncub.comm.votes import PendingAggregate


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


def add_count(total: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
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
