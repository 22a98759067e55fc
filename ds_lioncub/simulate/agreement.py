"""How a compressed step's update agrees with exact Lion's: the sign match, flip, zero and tie rates.

Exact Lion's direction at a step is ``sign(mean_i c_i)``, the sign of the workers' mean pre-sign
update (what exact Lion would apply from the same momenta). The rates compare the update the
aggregation applied with it, per element, the way the Lion Cub paper's Figure 5 reports its
quantizers; the tie rate counts the elements whose vote summed to 0, as the telemetry counts them
(each worker's aggregation's ``tied_counts``, on its received messages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.lion import lion_direction
from ds_lioncub.step.bucket_plan import Piece
from ds_lioncub.step.bucket_work import Entry, grad_piece, piece_of


@dataclass(frozen=True)
class AgreementStats:
    """How the applied update's signs compare with exact Lion's ``sign(mean_i c_i)`` at the same step.

    Fractions of the step's elements (the Lion Cub paper's Figure 5 reports the same rates):

    Attributes:
        match: the applied sign equals exact Lion's.
        flip: the applied sign is the opposite of exact Lion's.
        zero: the applied update or exact Lion's is 0 (a "mean" aggregation where the workers cancel).
            ``match + flip + zero == 1``.
        tie: the vote was tied (summed to 0) and the tie rule chose the sign.
    """

    match: float
    flip: float
    zero: float
    tie: float


class AgreementTally:
    """Counts of :class:`AgreementStats` over a step's buckets."""

    def __init__(self) -> None:
        self.elements = 0
        self.match = 0
        self.flip = 0
        self.tie = 0

    def add(
        self, exact_c: torch.Tensor, applied: torch.Tensor, aggregators: list[Aggregator], pending: list[object]
    ) -> None:
        """One bucket: ``exact_c`` (the summed pre-sign updates), ``applied`` (the update), each worker's vote."""
        exact_sign, applied_sign = torch.sign(exact_c), torch.sign(applied)
        nonzero = exact_sign != 0
        self.elements += exact_c.numel()
        self.match += int(((applied_sign == exact_sign) & nonzero).sum())
        self.flip += int(((applied_sign == -exact_sign) & nonzero).sum())
        owner_share = False
        counts = []
        for aggregator, mine in zip(aggregators, pending, strict=True):
            count, owner_share = aggregator.tied_counts(mine)
            counts.append(int(count))
        # The chunk owners' counts add up to the bucket's; an all-reduce leaves every rank the whole count.
        self.tie += sum(counts) if owner_share else counts[0]

    def stats(self) -> AgreementStats:
        total = max(self.elements, 1)
        return AgreementStats(
            match=self.match / total,
            flip=self.flip / total,
            zero=(self.elements - self.match - self.flip) / total,
            tie=self.tie / total,
        )


def summed_directions(entries: list[list[Entry]], bucket: list[Piece]) -> torch.Tensor:
    """The workers' pre-sign updates of the bucket summed in worker order: sign(sum) is exact Lion's direction."""
    first = entries[0][bucket[0].tensor_index].param
    total = torch.zeros(sum(piece.length for piece in bucket), dtype=torch.float32, device=first.device)
    for mine in entries:
        for piece, out in zip(bucket, total.split([piece.length for piece in bucket]), strict=True):
            entry = mine[piece.tensor_index]
            out.add_(
                lion_direction(piece_of(entry.exp_avg, piece), grad_piece(entry.grad, piece), entry.group["betas"][0])
            )
    return total


__all__ = ["AgreementStats", "AgreementTally", "summed_directions"]
