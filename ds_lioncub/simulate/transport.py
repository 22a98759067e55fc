"""The wire between the N virtual ranks of one process.

:class:`VirtualNetwork` hands out one :class:`VirtualTransport` per virtual rank. Each is a real
:class:`~ds_lioncub.comm.transport.TransportBase`: the library's aggregations run on it unchanged and
its counters count the bytes a real rank would send. Only the raw data movement differs.

Collectives are matched as torch.distributed matches them: the k-th collective a rank issues meets
the k-th collective of every other rank. A collective completes when the last rank issues it, and
its result is read only after that. So a driver runs each stage of a step on ranks 0..N-1 in turn
(every rank issues, then every rank waits), never one rank's whole step before the next rank's: the
order :class:`~ds_lioncub.simulate.world.VirtualLionCub` keeps. Waiting for a collective some rank has
not issued yet raises instead of hanging.

The floating-point sum is the library's rank-order sum (:func:`sum_rows_in_rank_order`) over every
rank's whole tensor, which per element is the same arithmetic as the chunked reduction of real
transports, hence the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_lioncub.comm.transport import TransportBase, sum_rows_in_rank_order


@dataclass
class _Collective:
    """One collective as the ranks issue it: its kind and, per rank so far, (sent, where the result goes)."""

    kind: str
    sent: list[torch.Tensor] = field(default_factory=list)
    results: list[torch.Tensor] = field(default_factory=list)
    done: bool = False


class _Completion:
    """What a rank waits on: its collective, which must be complete (every rank issued it) by then."""

    def __init__(self, collective: _Collective) -> None:
        self._collective = collective

    def wait(self) -> None:
        if not self._collective.done:
            raise RuntimeError(
                f"virtual world: a rank waited for a {self._collective.kind} that only "
                f"{len(self._collective.sent)} rank(s) have issued; drive each stage on every rank before waiting"
            )


class VirtualNetwork:
    """Matches and completes the collectives of ``world_size`` virtual ranks (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a virtual world needs at least one rank, got {world_size}")
        self.world_size = world_size
        self._issued = [0] * world_size  # collectives issued by each rank so far
        self._open: dict[int, _Collective] = {}  # by issue index, until the last rank issues it
        self.transports = [VirtualTransport(self, rank) for rank in range(world_size)]

    def issue(self, rank: int, kind: str, sent: torch.Tensor, result: torch.Tensor) -> _Completion:
        """Rank ``rank``'s next collective; it runs when the last rank has issued the same one."""
        index = self._issued[rank]
        self._issued[rank] += 1
        collective = self._open.setdefault(index, _Collective(kind))
        if collective.kind != kind or len(collective.sent) != rank:
            raise RuntimeError(
                f"virtual world: rank {rank} issued collective #{index} as a {kind}, but the ranks before it "
                f"issued {len(collective.sent)} {collective.kind}(s); every rank must issue the same collectives "
                f"in the same order, ranks 0..N-1 in turn"
            )
        collective.sent.append(sent)
        collective.results.append(result)
        if rank == self.world_size - 1:
            del self._open[index]
            _COMPLETE[kind](collective)
            collective.done = True
            collective.sent = []  # results stay referenced by the ranks' own tensors
        return _Completion(collective)

    @property
    def idle(self) -> bool:
        """Whether every collective issued so far has completed (every rank issued it)."""
        return not self._open


def _all_to_all(collective: _Collective) -> None:
    world_size = len(collective.sent)
    rows = [sent.view(world_size, -1) for sent in collective.sent]
    for receiver, result in enumerate(collective.results):
        result.view(world_size, -1).copy_(torch.stack([row[receiver] for row in rows]))


def _all_gather(collective: _Collective) -> None:
    gathered = torch.cat(collective.sent)
    for result in collective.results:
        result.copy_(gathered)


# The sums stack every rank's tensor before writing any result: a rank's sent tensor is its result tensor.
def _integer_sum(collective: _Collective) -> None:
    # Wider than the fields while summing, then cast back: a uint8 sum wraps as gloo's does (the codecs
    # keep the fields from ever carrying, so it never happens in their messages).
    total = torch.stack(collective.sent).to(torch.int64).sum(dim=0).to(collective.sent[0].dtype)
    for result in collective.results:
        result.copy_(total)


def _float_sum(collective: _Collective) -> None:
    total = sum_rows_in_rank_order(torch.stack(collective.sent))
    for result in collective.results:
        result.copy_(total)


_COMPLETE = {
    "all-to-all": _all_to_all,
    "all-gather": _all_gather,
    "integer all-reduce": _integer_sum,
    "float all-reduce": _float_sum,
}


class VirtualTransport(TransportBase):
    """Rank ``rank`` of a :class:`VirtualNetwork`: the library's collectives, with the network moving the bytes.

    A blocking collective returns at once; its result is written when the last rank issues it (see the
    module docstring), so its caller reads it only after that. An all-reduce sums in place: its
    tensor must be contiguous (the aggregations' buckets are), or the base class would copy a result
    back before it exists.
    """

    name = "virtual"
    supports_async = True

    def __init__(self, network: VirtualNetwork, rank: int) -> None:
        super().__init__(network.world_size, rank)
        self.network = network

    def _raw_all_to_all_async(self, send: torch.Tensor, received: torch.Tensor) -> _Completion:
        return self.network.issue(self.rank, "all-to-all", send, received)

    def _raw_all_gather_async(self, send: torch.Tensor, received: torch.Tensor) -> _Completion:
        return self.network.issue(self.rank, "all-gather", send, received)

    def _raw_integer_all_reduce_sum_async(self, flat: torch.Tensor) -> _Completion:
        return self.network.issue(self.rank, "integer all-reduce", flat, flat)

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self._raw_all_to_all_async(send, received)

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self._raw_all_gather_async(send, received)

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        self._raw_integer_all_reduce_sum_async(flat)

    def _ordered_float_sum(self, flat: torch.Tensor) -> None:
        if flat.numel():
            self.network.issue(self.rank, "float all-reduce", flat, flat)


__all__ = ["VirtualNetwork", "VirtualTransport"]
