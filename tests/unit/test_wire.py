"""ds_lioncub.comm.wire: the bytes each rank sends, per collective and per aggregation mode.

The per-collective formulas are checked against plain-loop simulations of the algorithms they model
(ring all-gather, ring reduce-scatter + ring all-gather, pairwise all-to-all), which count what every
simulated rank sends and check that every rank ends up with what the collective promises. The
per-mode formulas are checked against the collectives CompressedBackend really issues for the mode
(recorded by a transport that only records), each costed by those simulations.
"""

from __future__ import annotations

import pytest
import torch

from ds_lioncub.comm import CompressedBackend, wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.transport import CommStats, InFlight
from ds_lioncub.comm.vocabulary import (
    AGGREGATIONS,
    KBIT_ALGORITHMS,
    QUANTIZERS,
    Aggregation,
    KbitAlgorithm,
    Quantizer,
)

WORLD_SIZES = (1, 2, 3, 4, 5, 8)

# ---------------------------------------------------------------------------------------------- simulations


def simulate_ring_all_gather(block_bytes: list[int]) -> list[int]:
    """Bytes each rank sends when rank r's block (``block_bytes[r]`` bytes) travels around the ring.

    In each of the p - 1 steps every rank passes to its right neighbour the block it received in
    the step before (its own block first).
    """
    p = len(block_bytes)
    sent = [0] * p
    has = [{rank} for rank in range(p)]
    forwarding = list(range(p))
    for _ in range(p - 1):
        arriving = [0] * p
        for rank in range(p):
            block = forwarding[rank]
            sent[rank] += block_bytes[block]
            right = (rank + 1) % p
            has[right].add(block)
            arriving[right] = block
        forwarding = arriving
    assert all(blocks == set(range(p)) for blocks in has), "the simulated ring did not deliver every block"
    return sent


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` bytes in ``parts`` chunks whose sizes differ by at most one byte."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def simulate_ring_all_reduce(message_bytes: int, p: int) -> list[int]:
    """Bytes each rank sends in a ring reduce-scatter followed by a ring all-gather of the reduced chunks."""
    chunk_bytes = split_evenly(message_bytes, p)
    sent = [0] * p
    # contributions[rank][chunk]: whose values the partial sum of that chunk held by that rank contains
    contributions = [[{rank} for _ in range(p)] for rank in range(p)]
    for step in range(p - 1):
        for rank in range(p):
            chunk = (rank - step) % p
            sent[rank] += chunk_bytes[chunk]
            right = (rank + 1) % p
            contributions[right][chunk] |= contributions[rank][chunk]
    owners: dict[int, int] = {}
    for rank in range(p):
        complete = [chunk for chunk in range(p) if contributions[rank][chunk] == set(range(p))]
        assert len(complete) == 1, "after the reduce-scatter each rank owns exactly one fully reduced chunk"
        owners[complete[0]] = rank
    assert sorted(owners) == list(range(p))
    # ring all-gather of the reduced chunks: rank r contributes the chunk it owns
    owned_bytes = [0] * p
    for chunk, rank in owners.items():
        owned_bytes[rank] = chunk_bytes[chunk]
    gathered = simulate_ring_all_gather(owned_bytes)
    return [a + b for a, b in zip(sent, gathered, strict=True)]


def simulate_pairwise_all_to_all(message_bytes: int, p: int) -> list[int]:
    """Bytes each rank sends when it hands chunk j of its message straight to rank j."""
    assert message_bytes % p == 0
    chunk = message_bytes // p
    sent = [0] * p
    received: list[list[int | None]] = [[None] * p for _ in range(p)]
    for rank in range(p):
        received[rank][rank] = rank  # its own chunk stays where it is
        for target in range(p):
            if target != rank:
                sent[rank] += chunk
                received[target][rank] = rank
    assert all(row == list(range(p)) for row in received)
    return sent


def mean_rounded_down(per_rank: list[int]) -> int:
    return sum(per_rank) // len(per_rank)


# ---------------------------------------------------------------------------------------------- per collective


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("chunk", [0, 1, 3, 16, 1000])
def test_all_to_all_sends_every_chunk_but_its_own(p: int, chunk: int) -> None:
    message = chunk * p
    per_rank = simulate_pairwise_all_to_all(message, p)
    assert len(set(per_rank)) == 1
    assert wire.all_to_all_bytes(message, p) == per_rank[0]


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("message", [0, 1, 7, 64, 1001])
def test_all_gather_forwards_p_minus_1_messages_around_the_ring(p: int, message: int) -> None:
    per_rank = simulate_ring_all_gather([message] * p)
    assert len(set(per_rank)) == 1
    assert wire.all_gather_bytes(message, p) == per_rank[0]


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("message", [0, 1, 7, 64, 1001, 4 * 999_983])
def test_all_reduce_is_the_mean_over_ranks_of_a_ring_reduce_scatter_plus_all_gather(p: int, message: int) -> None:
    per_rank = simulate_ring_all_reduce(message, p)
    assert wire.all_reduce_bytes(message, p) == mean_rounded_down(per_rank)


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_all_reduce_of_a_message_of_p_equal_chunks_costs_every_rank_the_same(p: int) -> None:
    per_rank = simulate_ring_all_reduce(120 * p, p)
    assert per_rank == [wire.all_reduce_bytes(120 * p, p)] * p


def test_a_world_of_one_sends_nothing() -> None:
    assert wire.all_to_all_bytes(4096, 1) == wire.all_gather_bytes(4096, 1) == wire.all_reduce_bytes(4096, 1) == 0


# ---------------------------------------------------------------------------------------------- per mode


class RecordingTransport:
    """A transport of ``world_size`` ranks that moves nothing: it records each collective and its message size.

    Outputs have the shapes the real collectives return (as if every rank had sent this rank's
    message), so CompressedBackend runs to the end and issues exactly the collectives it always does.
    """

    name = "recording"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank = 0
        self.stats = CommStats()
        self.issued: list[tuple[str, int]] = []

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        self.issued.append(("all_to_all", send.numel() * send.element_size()))
        return send.clone()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        self.issued.append(("all_gather", send.numel() * send.element_size()))
        return send.reshape(-1).repeat(self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.issued.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return tensor

    # Issued collectives record the same and are done at once.
    supports_async = False

    def start_all_to_all(self, send: torch.Tensor) -> InFlight:
        return InFlight(self.all_to_all(send))

    def start_all_gather(self, send: torch.Tensor) -> InFlight:
        return InFlight(self.all_gather(send))

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> InFlight:
        return InFlight(self.all_reduce_sum(tensor))

    def wait(self, pending: InFlight) -> torch.Tensor:
        return pending._complete()


def simulated_cost(issued: list[tuple[str, int]], p: int) -> int:
    """Bytes per rank of the recorded collectives, each costed by its simulation."""
    total = 0
    for collective, message in issued:
        if collective == "all_to_all":
            total += mean_rounded_down(simulate_pairwise_all_to_all(message, p))
        elif collective == "all_gather":
            total += mean_rounded_down(simulate_ring_all_gather([message] * p))
        else:
            total += mean_rounded_down(simulate_ring_all_reduce(message, p))
    return total


def recording_backend(p: int) -> tuple[CompressedBackend, RecordingTransport]:
    backend = CompressedBackend()  # torch.distributed is not initialised here: a world of one ...
    transport = RecordingTransport(p)
    backend.transport = transport  # ... that now reports p ranks
    return backend, transport


NUMELS = (1, 7, 64, 1000, 4099)


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("numel", NUMELS)
def test_1bit_vote_costs_what_its_all_to_all_and_all_gather_send(p: int, numel: int) -> None:
    backend, transport = recording_backend(p)
    backend.vote_1bit(torch.randn(numel), step=1)
    assert [name for name, _ in transport.issued] == ["all_to_all", "all_gather"]
    assert wire.vote_1bit_bytes(numel, p) == simulated_cost(transport.issued, p)


def fields_fit(p: int, bits: int, quantizer: str, algorithm: str) -> bool:
    """Whether p ranks' b-bit fields can be summed inside one all-reduce (sign fields are 0/1, L1 fields 0..2L >= 2)."""
    return algorithm == "alltoall" or p * (1 if quantizer == "sign" else 2) <= 2**bits - 1


KBIT_CASES = [
    (bits, quantizer, algorithm, aggregation, p)
    for bits in (2, 4, 8)
    for quantizer in QUANTIZERS
    for algorithm in KBIT_ALGORITHMS
    for aggregation in AGGREGATIONS
    for p in (1, 2, 3, 8)
    if fields_fit(p, bits, quantizer, algorithm)
]


@pytest.mark.parametrize(("bits", "quantizer", "algorithm", "aggregation", "p"), KBIT_CASES)
def test_kbit_mode_costs_what_its_collectives_send(
    bits: int, quantizer: Quantizer, algorithm: KbitAlgorithm, aggregation: Aggregation, p: int
) -> None:
    for numel in NUMELS:
        backend, transport = recording_backend(p)
        update = torch.randn(numel)
        backend.vote_kbit(update, step=1, bits=bits, quantizer=quantizer, aggregation=aggregation, algorithm=algorithm)
        codec = KbitCodec.build(p, bits, quantizer, algorithm)
        got = wire.kbit_bytes(numel, codec, aggregation)
        assert got == simulated_cost(transport.issued, p), f"numel={numel}"


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("element_size", (4, 2))
def test_dense_update_costs_one_ring_all_reduce_of_its_values(p: int, element_size: int) -> None:
    for numel in NUMELS:
        expected = mean_rounded_down(simulate_ring_all_reduce(numel * element_size, p))
        assert wire.dense_all_reduce_bytes(numel, p, element_size) == expected


def test_1bit_vote_of_1000_elements_on_4_ranks_sends_192_bytes() -> None:
    # 1000 elements pad to 1024 (a multiple of 8 * 4): 128 bytes of signs, of which 3/4 leave the rank (96),
    # then each rank's 32-byte chunk of votes goes around a ring of 4 three times (96).
    assert wire.vote_1bit_bytes(1000, 4) == 192


def test_8bit_l1_mean_over_all_to_all_gathers_16_bit_sums_on_4_ranks() -> None:
    # L = 255 // 2 = 127, so 4 ranks' fields sum to at most 4 * 254 = 1016: 16 bits per element.
    # 1000 elements pad to 1024: all-to-all of 1024 bytes sends 768; 256 sums of 2 bytes, gathered, 3 * 512.
    codec = KbitCodec.build(4, 8, "l1", "alltoall")
    assert wire.kbit_bytes(1000, codec, "mean") == 768 + 3 * 512


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_vote_padding_is_the_next_multiple_of_8_times_p(p: int) -> None:
    for numel in range(0, 200):
        padded = numel
        while padded % (8 * p):
            padded += 1
        assert wire.vote_padded_numel(numel, p) == padded
