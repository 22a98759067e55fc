"""How a rank's step is driven: its stages come as rounds (a generator that yields after each round), and a round
issues collectives and reads only the results of collectives issued in earlier rounds.

A rank of a real job runs its rounds one after the other (:func:`run_rounds`): each collective completes as its
ranks reach it. The virtual world holds N ranks in one process, whose collectives complete only when the last rank
issues them, so it runs each round on every rank before the next (:func:`run_in_lockstep`). The step is written
once, for both.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import TypeVar

_Returned = TypeVar("_Returned")


def run_rounds(rounds: Generator[None, None, _Returned]) -> _Returned:
    """Every round of ``rounds``, one after the other; what the generator returns."""
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def run_in_lockstep(ranks: Sequence[Iterator[None]]) -> None:
    """Each round on every one of ``ranks`` in rank order, then the next round, until they end. They run the same
    step, so they end in the same round; one that ends sooner or later than rank 0 is a bug, and raises."""
    while True:
        ended = []
        for rounds in ranks:
            try:
                next(rounds)
                ended.append(False)
            except StopIteration:
                ended.append(True)
        if all(ended):
            return
        if any(ended):
            raise RuntimeError(f"virtual world: the ranks' steps ended in different rounds ({ended})")


__all__ = ["run_in_lockstep", "run_rounds"]
