"""The three-stage schedule that overlaps one piece's transfer with its neighbours' local work.

A compressed aggregation runs in three stages per piece (a bucket of the optimizer, a chunk of one
large vote): ``start`` packs the piece and issues its first collective, ``reduce`` waits for it,
reduces what arrived and issues the second, ``complete`` waits for that and unpacks or applies the
result. Pipelined, iteration k runs [start piece k] [reduce piece k-1] [complete piece k-2]: while one
piece's messages travel, the next is packed and an earlier one unpacked, so the wire and the local
passes work at the same time instead of taking turns. Serial, each piece runs to the end before the
next starts.

The order is a function of the piece count alone, so every rank issues the same collectives in the
same order. Each piece's result depends only on the ranks' messages of that piece, so the schedule
changes when work happens, never a bit of a result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

#: Elements per chunk of one large vote (``CompressedBackend``'s ``pipeline_chunk_numel`` default, and
#: the planner's model of it). Smaller chunks start the wire sooner and overlap more of the packing and
#: unpacking with it, but each chunk pays two collectives' latency; on the emulated 1 Gbit/s network a
#: 1e8-element 1-bit vote among 2 ranks was fastest at 8 Mi (benchmarks/RESULTS.md).
DEFAULT_PIPELINE_CHUNK_NUMEL = 1 << 23

Issued = TypeVar("Issued")
Reduced = TypeVar("Reduced")


def run_three_stages(
    count: int,
    start: Callable[[int], Issued],
    reduce: Callable[[int, Issued], Reduced],
    complete: Callable[[int, Reduced], object],
    pipelined: bool = True,
) -> None:
    """Run ``start(k)``, ``reduce(k, started)``, ``complete(k, reduced)`` for pieces ``0..count-1``: every round
    of :func:`three_stage_rounds`, one after the other."""
    for _ in three_stage_rounds(count, start, reduce, complete, pipelined):
        pass


def three_stage_rounds(
    count: int,
    start: Callable[[int], Issued],
    reduce: Callable[[int, Issued], Reduced],
    complete: Callable[[int, Reduced], object],
    pipelined: bool = True,
) -> Iterator[None]:
    """:func:`staged_rounds` of the three stages ``start(k)``, ``reduce(k, started)``, ``complete(k, reduced)``."""
    return staged_rounds(count, [lambda k, _: start(k), reduce, complete], pipelined)


def staged_rounds(count: int, stages: Sequence[Callable[[int, Any], Any]], pipelined: bool = True) -> Iterator[None]:
    """Pieces ``0..count-1`` through ``stages`` in rounds, yielding after each round: stage j of piece k is
    ``stages[j](k, what stage j - 1 of piece k returned)`` (stage 0 gets None). A round issues collectives and reads
    only the results of collectives issued in earlier rounds, so a driver of several ranks in one process (the
    virtual world) runs each round on every rank before the next.

    Pipelined, each stage trails the one before by one round (at most ``len(stages)`` pieces in flight; within a
    round the later pieces' stages run first, as in :func:`run_three_stages`); serial, each stage of a piece is a
    round, and piece k completes before piece k+1 starts. What a stage returns is dropped once the next stage took
    it.
    """
    if not pipelined:
        for k in range(count):
            value: Any = None
            for stage in stages:
                value = stage(k, value)
                yield
        return
    handed: list[dict[int, Any]] = [{} for _ in stages]  # handed[j][k]: what stage j - 1 of piece k returned
    for round_number in range(count + len(stages) - 1 if count else 0):
        for j, stage in enumerate(stages):
            k = round_number - j
            if 0 <= k < count:
                value = stage(k, handed[j].pop(k, None))
                if j + 1 < len(stages):
                    handed[j + 1][k] = value
        yield


def chunk_bounds(numel: int, chunk_numel: int, multiple: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the chunks that cut ``numel`` elements into pieces of about ``chunk_numel``.

    Every chunk but the last holds a multiple of ``multiple`` elements (``chunk_numel`` rounded down,
    at least ``multiple``), so a protocol that pads each message to whole multiples pads only the
    last chunk, and the chunks together send exactly the bytes of one unchunked call.
    """
    if numel <= 0:
        return []
    step = max(multiple, chunk_numel // multiple * multiple)
    return [(begin, min(numel, begin + step)) for begin in range(0, numel, step)]


__all__ = ["DEFAULT_PIPELINE_CHUNK_NUMEL", "chunk_bounds", "run_three_stages", "staged_rounds", "three_stage_rounds"]
