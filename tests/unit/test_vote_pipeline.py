"""CompressedBackend's chunk pipeline: a vote cut into chunks gives the brute-force vote, sends the
unchunked call's bytes, and really overlaps its chunks.

Each rank is a thread (tests/support/thread_world.py) on a transport that moves data only when a
collective is waited for, so a pipeline that read a chunk's result early, reused a buffer still
being sent, or waited out of issue order would fail here. References: the brute-force votes of
tests/support/reference.py and the wire formulas of ds_lioncub/comm/wire.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub.comm import CompressedBackend, wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.schedule import chunk_bounds, run_three_stages
from ds_lioncub.errors import LionCubConfigError
from tests.support import scenarios as sc
from tests.support.reference import brute_force_vote_1bit, brute_force_vote_kbit, max_world_size_allreduce
from tests.support.thread_world import DeferredThreadTransport, ThreadTransport, on_every_rank

WORLD_SIZES = (1, 2, 3, 4)
# Chunks of 3 padding units (24 p elements) cut KBIT_SIZE = 2053 elements, and its L1 segments, into
# many pieces; 1000 elements is not a multiple of 8 p for p = 3.
CHUNKS = (lambda p: 24 * p, lambda p: 1000)


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("chunk", CHUNKS, ids=("24p", "1000"))
@pytest.mark.parametrize("in_place", (False, True), ids=("new-tensor", "out=update"))
def test_chunked_vote_1bit_equals_the_brute_force_vote(p: int, chunk: Any, in_place: bool) -> None:
    size, step = sc.KBIT_SIZE, 1
    inputs = [sc.laplace_input(size, rank, step) for rank in range(p)]

    def vote(transport: ThreadTransport) -> dict[str, Any]:
        backend = CompressedBackend.from_transport(transport, pipeline_chunk_numel=chunk(p))
        update = inputs[transport.rank].clone()
        got = backend.vote_1bit(update, step, out=update if in_place else None)
        return {"vote": got, "stats": backend.comm_stats(), "issued": list(transport.issued)}

    results = on_every_rank(p, vote, DeferredThreadTransport)
    expected = brute_force_vote_1bit(inputs, step)
    chunks = chunk_bounds(size, chunk(p), 8 * p)
    assert len(chunks) > 2
    for result in results:
        assert torch.equal(result["vote"], expected)
        # The chunks together send the bytes of one unchunked vote, in two collectives per chunk.
        assert result["stats"].bytes_sent == (wire.vote_1bit_bytes(size, p) if p > 1 else 0)
        assert result["stats"].collectives == (2 * len(chunks) if p > 1 else 0)


@pytest.mark.parametrize("p", (2, 3))
def test_chunked_vote_issues_the_next_chunks_all_to_all_before_the_last_ones_all_gather(p: int) -> None:
    """Chunk k+1's signs go out before chunk k's vote is gathered: packing overlaps the wire."""
    size = 10 * 8 * p + 5  # eleven chunks of one padding unit each

    def vote(transport: DeferredThreadTransport) -> list[str]:
        backend = CompressedBackend.from_transport(transport, pipeline_chunk_numel=8 * p)
        backend.vote_1bit(sc.laplace_input(size, transport.rank, 1), 1)
        return list(transport.issued)

    issued = on_every_rank(p, vote, DeferredThreadTransport)
    assert all(order == issued[0] for order in issued), "every rank issues the same collectives in order"
    count = len(chunk_bounds(size, 8 * p, 8 * p))
    # Built one iteration at a time: chunk k's all-to-all, then chunk k-1's all-gather.
    expected: list[str] = []
    for k in range(count + 1):
        expected += ["all_to_all"] * (k < count) + ["all_gather"] * (k >= 1)
    assert issued[0] == expected


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("case", sc.kbit_cases(1), ids=sc.case_name)
def test_chunked_vote_kbit_equals_the_brute_force_vote(p: int, case: dict[str, Any]) -> None:
    if case["algorithm"] == "allreduce" and p > max_world_size_allreduce(case["bits"], case["quantizer"]):
        pytest.skip("this world is too large for the all-reduce fields (the refusal is tested elsewhere)")
    size, step = sc.KBIT_SIZE, 2
    segments = list(sc.KBIT_SEGMENTS) if case["quantizer"] == "l1" else None
    inputs = [sc.laplace_input(size, rank, step) for rank in range(p)]

    def vote(transport: ThreadTransport) -> dict[str, Any]:
        backend = CompressedBackend.from_transport(transport, pipeline_chunk_numel=24 * p)
        got = backend.vote_kbit(inputs[transport.rank], step, segment_sizes=segments, **case)
        return {"vote": got, "stats": backend.comm_stats()}

    results = on_every_rank(p, vote, DeferredThreadTransport)
    # An L1 chunk boundary falls inside a segment: the chunk must still use the whole segment's mean.
    expected = brute_force_vote_kbit(inputs, step, segment_sizes=segments, **case)
    codec = KbitCodec.build(p, case["bits"], case["quantizer"], case["algorithm"])
    for result in results:
        assert torch.equal(result["vote"], expected), sc.case_name(case)
        assert result["stats"].bytes_sent == (wire.kbit_bytes(size, codec, case["aggregation"]) if p > 1 else 0)


def test_chunk_bounds_cover_the_elements_in_whole_padding_units() -> None:
    for numel in (0, 1, 7, 8, 9, 95, 96, 97, 2053):
        for chunk_numel in (1, 8, 20, 24, 100, 10**6):
            for multiple in (8, 24):
                bounds = chunk_bounds(numel, chunk_numel, multiple)
                covered = [index for begin, end in bounds for index in range(begin, end)]
                assert covered == list(range(numel))
                assert all((end - begin) % multiple == 0 for begin, end in bounds[:-1])
                assert all(end - begin <= max(chunk_numel, multiple) for begin, end in bounds)


def test_three_stages_run_in_the_pipelined_and_the_serial_order() -> None:
    events: list[tuple[str, int]] = []
    count = 4

    def record(stage: str) -> Any:
        return lambda k, *_: events.append((stage, k)) or k

    run_three_stages(count, record("start"), record("reduce"), record("complete"))
    pipelined = list(events)
    events.clear()
    run_three_stages(count, record("start"), record("reduce"), record("complete"), pipelined=False)
    assert events == [(stage, k) for k in range(count) for stage in ("start", "reduce", "complete")]
    # Pipelined: every stage runs once per piece, after its piece's previous stage, and piece k+1
    # starts before piece k is reduced.
    assert sorted(pipelined) == sorted(events)
    for k in range(count):
        assert pipelined.index(("start", k)) < pipelined.index(("reduce", k)) < pipelined.index(("complete", k))
        if k + 1 < count:
            assert pipelined.index(("start", k + 1)) < pipelined.index(("reduce", k))
            assert pipelined.index(("reduce", k + 1)) < pipelined.index(("complete", k))


@pytest.mark.parametrize("value", (0, -8, 1.5, True, "8Mi"))
def test_pipeline_chunk_numel_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(LionCubConfigError, match="pipeline_chunk_numel must be a positive int"):
        CompressedBackend(pipeline_chunk_numel=value)
