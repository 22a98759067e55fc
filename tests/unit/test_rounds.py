"""The step's rounds (ds_lioncub/step/rounds.py, comm/schedule.py's ``staged_rounds``): what a round may issue and
read, against a hand-written schedule, and the virtual world's lockstep driver.

The rule every round keeps: a stage reads only what stages of earlier rounds issued. A driver of N ranks in one
process depends on it (the virtual world's collectives complete only when the last rank issues them).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from ds_lioncub.comm.schedule import staged_rounds
from ds_lioncub.step.rounds import run_in_lockstep, run_rounds


def rounds_of(count: int, depth: int, pipelined: bool) -> list[list[tuple[int, int]]]:
    """(stage, piece) of every stage call, grouped by the round it ran in, and each stage's input checked."""
    log: list[tuple[int, int]] = []

    def stage(j: int):  # type: ignore[no-untyped-def]
        def run(k: int, handed: object) -> tuple[int, int]:
            assert handed == (None if j == 0 else (j - 1, k))  # what stage j - 1 of the same piece returned
            log.append((j, k))
            return (j, k)

        return run

    grouped = []
    for _ in staged_rounds(count, [stage(j) for j in range(depth)], pipelined):
        grouped.append(list(log))
        log.clear()
    assert not log  # nothing runs after the last yield
    return grouped


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_pipelined_round_r_runs_stage_j_of_piece_r_minus_j_later_pieces_first(count: int, depth: int) -> None:
    expected = [
        [(j, r - j) for j in range(depth) if 0 <= r - j < count] for r in range(count + depth - 1 if count else 0)
    ]
    assert rounds_of(count, depth, pipelined=True) == expected


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_serial_runs_one_stage_a_round_piece_after_piece(depth: int) -> None:
    assert rounds_of(3, depth, pipelined=False) == [[(j, k)] for k in range(3) for j in range(depth)]


def test_lockstep_runs_each_round_on_every_rank_in_rank_order_then_the_next() -> None:
    log: list[tuple[int, int]] = []

    def rank(r: int, count: int) -> Iterator[None]:
        for n in range(count):
            log.append((n, r))
            yield

    run_in_lockstep([rank(r, 3) for r in range(4)])
    assert log == [(n, r) for n in range(3) for r in range(4)]
    with pytest.raises(RuntimeError, match="different rounds"):
        run_in_lockstep([rank(0, 2), rank(1, 3)])


def test_run_rounds_returns_what_the_rounds_return() -> None:
    def rounds() -> Generator[None, None, int]:
        yield
        yield
        return 7

    assert run_rounds(rounds()) == 7
