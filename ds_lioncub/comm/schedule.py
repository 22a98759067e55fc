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

from collections.abc import Callable
from typing import TypeVar

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
    """Run ``start(k)``, ``reduce(k, started)``, ``complete(k, reduced)`` for pieces ``0..count-1``.

    Pipelined, each stage trails the one before by one iteration (at most three pieces in flight);
    serial, piece k completes before piece k+1 starts. A piece's ``start`` result is dropped once it
    is reduced, and its ``reduce`` result once it is completed, so at most three are held at a time.
    """
    lag = 1 if pipelined else 0
    started: dict[int, Issued] = {}
    reduced: dict[int, Reduced] = {}
    for k in range(count + 2 * lag):
        if k < count:
            started[k] = start(k)
        if 0 <= k - lag < count:
            reduced[k - lag] = reduce(k - lag, started.pop(k - lag))
        if 0 <= k - 2 * lag < count:
            complete(k - 2 * lag, reduced.pop(k - 2 * lag))


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


__all__ = ["DEFAULT_PIPELINE_CHUNK_NUMEL", "chunk_bounds", "run_three_stages"]
