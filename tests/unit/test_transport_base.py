"""TransportBase: the public collectives every transport inherits, checked on in-process worlds.

A world of p ranks is simulated with p threads whose raw hooks meet at a barrier, so the base's own
logic (the world of one, the rank-order float sum, padding, non-contiguous tensors, the byte
accounting, and instrumenting by replacing public methods) is tested without a process group.
Results are compared with sums written out here, byte counts with the counts of the algorithms'
textbook descriptions.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_lioncub.comm.transport import (
    COMMUNICATING_METHODS,
    CommStats,
    TorchTransport,
    TransportBase,
    cuda_aware_conflict,
    import_mpi,
    make_transport,
)
from ds_lioncub.comm.transport import base as base_module
from ds_lioncub.errors import LionCubConfigError, MissingDependencyError
from tests.support.thread_world import DeferredThreadTransport, ThreadTransport, on_every_rank


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=generator, dtype=torch.float64) * 10 ** (rank % 3)).to(dtype)
    return torch.randint(0, 100, (numel,), generator=generator).to(dtype)


def rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """((x0 + x1) + x2) + ...; fp16/bf16 accumulated in fp32 and rounded once."""
    wide = inputs[0].dtype in (torch.float16, torch.bfloat16)
    total = inputs[0].float() if wide else inputs[0].clone()
    for x in inputs[1:]:
        total = total + (x.float() if wide else x)
    return total.to(inputs[0].dtype)


# ---------------------------------------------------------------------------------------------- world of one


class NoWireTransport(TransportBase):
    """A world of one whose raw hooks fail the test if anything reaches them."""

    name = "alone"

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        raise AssertionError("a world of one must not communicate")

    _raw_all_gather = _raw_all_to_all

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        raise AssertionError("a world of one must not communicate")


def world_of_one_transports() -> list[TransportBase]:
    transports: list[TransportBase] = [NoWireTransport(1, 0)]
    if not dist.is_initialized():
        transports.append(TorchTransport())
    return transports


@pytest.mark.parametrize("transport", world_of_one_transports(), ids=lambda t: t.name)
def test_world_of_one_returns_copies_and_counts_nothing(transport: TransportBase) -> None:
    assert transport.world_size == 1
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        send = rank_input(0, 24, dtype).view(4, 6)
        original = send.clone()
        for collective in (transport.all_to_all, transport.all_gather):
            received = collective(send)
            assert torch.equal(received, original) and received.shape == send.shape
            assert received.data_ptr() != send.data_ptr()
            received.zero_()
            assert torch.equal(send, original), "writing the output must not change the input"
        assert transport.all_reduce_sum(send) is send
        assert torch.equal(send, original)
    assert (transport.stats.collectives, transport.stats.bytes_sent, transport.stats.bytes_received) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------- p ranks


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("numel", (1, 5, 12, 1001))
def test_float_sum_is_bit_identical_to_the_rank_order_sum_on_every_rank(p: int, dtype: torch.dtype, numel: int) -> None:
    def run(transport: ThreadTransport) -> torch.Tensor:
        tensor = rank_input(transport.rank, numel, dtype)
        assert transport.all_reduce_sum(tensor) is tensor
        return tensor

    expected = rank_order_sum([rank_input(rank, numel, dtype) for rank in range(p)])
    for got in on_every_rank(p, run):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("p", (2, 3))
def test_float_sum_of_a_non_contiguous_tensor_is_written_back_in_place(p: int) -> None:
    def run(transport: ThreadTransport) -> torch.Tensor:
        strided = rank_input(transport.rank, 48, torch.float32).view(6, 8).t()
        transport.all_reduce_sum(strided)
        return strided

    expected = rank_order_sum([rank_input(rank, 48, torch.float32).view(6, 8).t() for rank in range(p)])
    for got in on_every_rank(p, run):
        assert not got.is_contiguous() and torch.equal(got, expected)


@pytest.mark.parametrize("p", (2, 3))
def test_float_sum_of_an_empty_tensor_moves_nothing_but_counts_one_collective(p: int) -> None:
    def run(transport: ThreadTransport) -> tuple[list[str], int, int]:
        transport.all_reduce_sum(torch.empty(0))
        return transport.raw_calls, transport.stats.collectives, transport.stats.bytes_sent

    assert on_every_rank(p, run) == [([], 1, 0)] * p


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("dtype", (torch.uint8, torch.int32, torch.int64))
def test_integer_sum_goes_to_the_integer_hook(p: int, dtype: torch.dtype) -> None:
    def run(transport: ThreadTransport) -> tuple[torch.Tensor, list[str]]:
        tensor = rank_input(transport.rank, 37, dtype)
        transport.all_reduce_sum(tensor)
        return tensor, transport.raw_calls

    inputs = [rank_input(rank, 37, dtype).to(torch.int64) for rank in range(p)]
    expected = sum(inputs[1:], inputs[0]).to(dtype)
    for got, calls in on_every_rank(p, run):
        assert torch.equal(got, expected) and calls == ["integer_all_reduce"]


@pytest.mark.parametrize("p", (2, 3, 4))
def test_all_to_all_delivers_chunk_j_of_every_rank_to_rank_j_in_rank_order(p: int) -> None:
    def message(rank: int) -> torch.Tensor:
        return torch.arange(p * 3, dtype=torch.int32) + 100 * rank  # chunk j: 3 values j*3.. of this rank

    results = on_every_rank(p, lambda transport: transport.all_to_all(message(transport.rank)))
    for rank, got in enumerate(results):
        assert torch.equal(got, torch.cat([message(sender)[3 * rank : 3 * rank + 3] for sender in range(p)]))


def test_all_to_all_refuses_a_message_that_does_not_split_into_p_chunks() -> None:
    with pytest.raises(ValueError, match="do not split into 3 equal chunks"):
        on_every_rank(3, lambda transport: transport.all_to_all(torch.zeros(7)))


@pytest.mark.parametrize("p", (2, 3, 4))
def test_all_gather_concatenates_every_rank_in_rank_order(p: int) -> None:
    results = on_every_rank(p, lambda transport: transport.all_gather(torch.full((2, 2), transport.rank)))
    expected = torch.cat([torch.full((4,), rank) for rank in range(p)])
    assert all(torch.equal(got, expected) for got in results)


@pytest.mark.parametrize("p", (2, 3, 4))
def test_each_call_counts_one_collective_and_the_bandwidth_optimal_bytes(p: int) -> None:
    def run(transport: ThreadTransport) -> list[tuple[int, ...]]:
        counts: list[tuple[int, ...]] = []
        for call in (
            lambda: transport.all_to_all(torch.zeros(10 * p, dtype=torch.uint8)),  # 10p bytes
            lambda: transport.all_gather(torch.zeros(5, dtype=torch.int64)),  # 40 bytes
            lambda: transport.all_reduce_sum(torch.zeros(25, dtype=torch.float32)),  # 100 bytes
            lambda: transport.all_reduce_sum(torch.zeros(7, dtype=torch.uint8)),  # 7 bytes
        ):
            before = (transport.stats.collectives, transport.stats.bytes_sent, transport.stats.bytes_received)
            call()
            after = (transport.stats.collectives, transport.stats.bytes_sent, transport.stats.bytes_received)
            counts.append(tuple(a - b for a, b in zip(after, before, strict=True)))
        return counts

    # pairwise all-to-all: p - 1 chunks of 10 bytes; ring all-gather: p - 1 messages;
    # ring all-reduce: 2 (p - 1) / p of the message, the mean over ranks rounded down.
    expected = [
        (1, 10 * (p - 1), 10 * (p - 1)),
        (1, 40 * (p - 1), 40 * (p - 1)),
        (1, 200 * (p - 1) // p, 200 * (p - 1) // p),
        (1, 14 * (p - 1) // p, 14 * (p - 1) // p),
    ]
    assert on_every_rank(p, run) == [expected] * p


class TickingClock:
    """A stand-in for time.perf_counter: each thread's own clock, one second further at every reading."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        self._local.now = getattr(self._local, "now", 0.0) + 1.0
        return float(self._local.now)


@pytest.mark.parametrize("p", (2, 3))
def test_each_collective_adds_the_clock_time_around_its_data_movement(p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clock readings per collective, around the raw hooks (both of a float sum's under one pair)."""
    monkeypatch.setattr(base_module.time, "perf_counter", TickingClock())

    def run(transport: ThreadTransport) -> tuple[int, float, float]:
        transport.all_to_all(rank_input(transport.rank, 6 * p, torch.float32))
        transport.all_gather(rank_input(transport.rank, 5, torch.uint8))
        transport.all_reduce_sum(rank_input(transport.rank, 7, torch.float32))  # all-to-all + all-gather inside
        before = transport.stats + CommStats()
        transport.all_reduce_sum(rank_input(transport.rank, 7, torch.int32))
        return transport.stats.collectives, transport.stats.seconds, (transport.stats - before).seconds

    assert on_every_rank(p, run) == [(4, 4.0, 1.0)] * p


def test_traffic_counts_compare_equal_whatever_the_seconds() -> None:
    assert CommStats(2, 10, 10, seconds=0.5) == CommStats(2, 10, 10, seconds=3.0)
    assert CommStats(2, 10, 10) != CommStats(2, 11, 10)
    total = CommStats(1, 4, 4, 0.25) + CommStats(2, 6, 6, 0.5)
    assert (total.collectives, total.bytes_sent, total.seconds) == (3, 10, 0.75)


@pytest.mark.parametrize("numel", (12, 13))
def test_float_sum_pads_only_when_the_tensor_does_not_split_into_p_chunks(numel: int) -> None:
    def run(transport: ThreadTransport) -> list[str]:
        transport.all_reduce_sum(torch.ones(numel))
        return transport.workspaces

    padded = numel % 4 != 0
    assert on_every_rank(4, run) == [["padded", "rows"] if padded else ["rows"]] * 4


def test_replacing_the_public_methods_times_each_call_once_and_counts_it_once() -> None:
    """What the benchmarks do: ``setattr(transport, name, timed(original))`` on the instance."""

    def run(transport: ThreadTransport) -> tuple[dict[str, int], int, list[str]]:
        calls = {"all_to_all": 0, "all_gather": 0, "all_reduce_sum": 0}
        for name in calls:
            original = getattr(transport, name)

            def timed(tensor: torch.Tensor, name: str = name, original: Any = original) -> torch.Tensor:
                calls[name] += 1
                return original(tensor)

            setattr(transport, name, timed)
        transport.all_reduce_sum(torch.ones(10))
        return calls, transport.stats.collectives, transport.raw_calls

    for calls, collectives, raw_calls in on_every_rank(3, run):
        assert calls == {"all_to_all": 0, "all_gather": 0, "all_reduce_sum": 1}
        assert collectives == 1
        assert raw_calls == ["all_to_all", "all_gather"]


# ---------------------------------------------------------------------------------------------- issued collectives


@pytest.mark.parametrize("transport", world_of_one_transports(), ids=lambda t: t.name)
def test_world_of_one_completes_issued_collectives_at_once_and_counts_nothing(transport: TransportBase) -> None:
    send = rank_input(0, 24, torch.uint8)
    for start in (transport.start_all_to_all, transport.start_all_gather, transport.start_all_reduce_sum):
        pending = start(send)
        assert torch.equal(transport.wait(pending), send)
        assert transport.wait(pending) is transport.wait(pending), "waiting again returns the same result"
    assert (transport.stats.collectives, transport.stats.bytes_sent) == (0, 0)


def issued_calls(p: int, transport: ThreadTransport) -> list[torch.Tensor]:
    """Every collective issued at once, waited for in issue order, each on its own rank's input."""
    rank = transport.rank
    pending = [
        transport.start_all_to_all(rank_input(rank, 6 * p, torch.uint8)),
        transport.start_all_gather(rank_input(rank, 7, torch.int32)),
        transport.start_all_reduce_sum(rank_input(rank, 9, torch.uint8)),
        transport.start_all_reduce_sum(rank_input(rank, 13, torch.float32)),
        transport.start_all_reduce_sum(rank_input(rank, 20, torch.int32).view(4, 5).t()),  # not contiguous
    ]
    return [transport.wait(one) for one in pending]


@pytest.mark.parametrize("transport_type", (ThreadTransport, DeferredThreadTransport), ids=lambda t: t.name)
@pytest.mark.parametrize("p", (2, 3, 4))
def test_issued_collectives_give_the_blocking_results_and_counts(p: int, transport_type: type[ThreadTransport]) -> None:
    def blocking(transport: ThreadTransport) -> tuple[list[torch.Tensor], tuple[int, int]]:
        rank = transport.rank
        results = [
            transport.all_to_all(rank_input(rank, 6 * p, torch.uint8)),
            transport.all_gather(rank_input(rank, 7, torch.int32)),
            transport.all_reduce_sum(rank_input(rank, 9, torch.uint8)),
            transport.all_reduce_sum(rank_input(rank, 13, torch.float32)),
            transport.all_reduce_sum(rank_input(rank, 20, torch.int32).view(4, 5).t()),
        ]
        return results, (transport.stats.collectives, transport.stats.bytes_sent)

    def issued(transport: ThreadTransport) -> tuple[list[torch.Tensor], tuple[int, int]]:
        results = issued_calls(p, transport)
        return results, (transport.stats.collectives, transport.stats.bytes_sent)

    expected = on_every_rank(p, blocking)
    got = on_every_rank(p, issued, transport_type)
    for (want, want_counts), (have, have_counts) in zip(expected, got, strict=True):
        assert have_counts == want_counts
        for one, other in zip(want, have, strict=True):
            assert torch.equal(one, other) and one.shape == other.shape
    # the non-contiguous sum is written back into the caller's tensor, as the blocking one is
    assert not got[0][0][4].is_contiguous()


def test_deferred_transport_delivers_nothing_before_the_wait() -> None:
    """The test double the optimizer's schedule is checked on really defers: results are garbage until waited."""

    def run(transport: DeferredThreadTransport) -> tuple[bool, bool]:
        pending = transport.start_all_gather(torch.full((3,), float(transport.rank)))
        early = bool(torch.isnan(pending._result).all())
        return early, torch.equal(transport.wait(pending), torch.tensor([0.0, 0, 0, 1, 1, 1]))

    assert on_every_rank(2, run, DeferredThreadTransport) == [(True, True)] * 2


def test_replacing_every_communicating_method_times_a_vote_once_per_collective() -> None:
    """What the benchmarks do for a vote, which issues its collectives and waits for them."""
    from ds_lioncub.comm.votes import finish_aggregate, reduce_sign_vote, start_sign_vote

    def run(transport: ThreadTransport) -> dict[str, int]:
        calls = dict.fromkeys(COMMUNICATING_METHODS, 0)
        for name in calls:
            original = getattr(transport, name)

            def timed(argument: Any, name: str = name, original: Any = original) -> Any:
                calls[name] += 1
                return original(argument)

            setattr(transport, name, timed)
        update = rank_input(transport.rank, 50, torch.float32)
        finish_aggregate(transport, reduce_sign_vote(transport, start_sign_vote(transport, update, True)), update)
        return calls

    expected = dict.fromkeys(COMMUNICATING_METHODS, 0) | {"start_all_to_all": 1, "start_all_gather": 1, "wait": 2}
    assert on_every_rank(3, run) == [expected] * 3


# ---------------------------------------------------------------------------------------------- errors


def test_cuda_aware_with_the_torch_backend_is_refused_with_the_configs_message() -> None:
    from ds_lioncub import parse_config

    message = cuda_aware_conflict("torch", True)
    assert message is not None and not message.endswith(".") and not message.startswith("LionCub")
    with pytest.raises(ValueError) as from_config:
        parse_config({"cuda_aware": True})
    assert message in str(from_config.value)
    with pytest.raises(LionCubConfigError) as from_factory:
        make_transport(None, "torch", cuda_aware=True)
    assert str(from_factory.value) == f"LionCub: {message}."


def test_cuda_aware_is_allowed_with_mpi_and_off_everywhere() -> None:
    assert cuda_aware_conflict("mpi", True) is None
    assert cuda_aware_conflict("torch", False) is None
    assert cuda_aware_conflict("mpi", False) is None


def test_an_unknown_backend_name_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(LionCubConfigError, match=r"^LionCub: comm_backend_name must be one of \['torch', 'mpi'\]"):
        make_transport(None, "nccl")


@pytest.mark.skipif(dist.is_initialized(), reason="needs torch.distributed not initialised")
def test_a_process_group_without_torch_distributed_is_a_config_error_that_names_the_fix() -> None:
    with pytest.raises(LionCubConfigError, match=r"^LionCub: a process_group was given.*init_distributed"):
        TorchTransport(process_group=object())  # type: ignore[arg-type]


def test_missing_mpi4py_is_a_missing_dependency_error_that_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(MissingDependencyError, match=r'^LionCub: .*needs mpi4py.*pip install "ds_lioncub\[mpi\]"'):
        import_mpi()
    assert issubclass(MissingDependencyError, ImportError)


# ---------------------------------------------------------------------------------------------- uncounted()


def _traffic(stats: CommStats) -> tuple[int, int, int, float]:
    return stats.collectives, stats.bytes_sent, stats.bytes_received, stats.seconds


@pytest.mark.parametrize("p", (2, 3))
def test_uncounted_leaves_the_blocks_collectives_out_and_keeps_counting_after_it(p: int) -> None:
    """Counted, uncounted, counted: the stats equal a run of the two counted collectives alone."""

    def with_block(transport: ThreadTransport) -> tuple[CommStats, int, list[str]]:
        transport.all_gather(rank_input(transport.rank, 6, torch.uint8))
        with transport.uncounted():
            transport.all_reduce_sum(rank_input(transport.rank, 50, torch.int32))
            transport.all_to_all(rank_input(transport.rank, 12 * p, torch.float32))
            counted_inside = transport.stats.collectives
        transport.all_reduce_sum(rank_input(transport.rank, 7, torch.float32))
        return transport.stats, counted_inside, transport.raw_calls

    def without_block(transport: ThreadTransport) -> CommStats:
        transport.all_gather(rank_input(transport.rank, 6, torch.uint8))
        transport.all_reduce_sum(rank_input(transport.rank, 7, torch.float32))
        return transport.stats

    for (stats, counted_inside, raw_calls), reference in zip(
        on_every_rank(p, with_block), on_every_rank(p, without_block), strict=True
    ):
        assert "integer_all_reduce" in raw_calls and "all_to_all" in raw_calls  # the block did communicate
        assert counted_inside == 3  # counted while inside (a caller may read them there) ...
        assert stats.collectives == 2  # ... and taken back when the block ends
        assert (stats.bytes_sent, stats.bytes_received) == (reference.bytes_sent, reference.bytes_received)
        assert stats.bytes_sent > 0


def test_uncounted_restores_the_stats_when_the_block_raises() -> None:
    class BlockFailed(Exception):
        pass

    def run(transport: ThreadTransport) -> tuple[tuple[int, int, int, float], tuple[int, int, int, float]]:
        transport.all_gather(rank_input(transport.rank, 5, torch.uint8))
        before = _traffic(transport.stats)
        with pytest.raises(BlockFailed):
            with transport.uncounted():
                transport.all_gather(rank_input(transport.rank, 40, torch.uint8))
                assert transport.stats.collectives == 2
                raise BlockFailed
        return before, _traffic(transport.stats)

    for before, after in on_every_rank(2, run):
        assert after == before  # seconds included: the block's time is not the training's either
        assert after[:3] == (1, 5, 5)  # one 5-byte all-gather between 2 ranks: 5 bytes out, 5 in


def test_uncounted_in_a_world_of_one_keeps_the_stats_object_values() -> None:
    transport = NoWireTransport(1, 0)
    transport.stats = CommStats(3, 40, 40, 0.5)
    with transport.uncounted():
        transport.stats.collectives += 9  # as a collective would
    assert _traffic(transport.stats) == (3, 40, 40, 0.5)
