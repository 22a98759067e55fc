"""p ranks as threads of one process, for collectives without a process group.

:class:`ThreadTransport` runs :class:`~ds_lioncub.comm.transport.TransportBase`'s raw hooks over a
:class:`ThreadWorld` whose ranks meet at a barrier. :class:`DeferredThreadTransport` leaves every
issued collective undone until it is waited for, so it reads the sent message as late as a real
library may and delivers nothing earlier: code that reuses a sent buffer, or reads a result before
waiting, fails on it. :class:`ThreadLionCub` is a LionCub over such a transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ds_lioncub import LionCub
from ds_lioncub.comm.transport import Transport, TransportBase


class ThreadWorld:
    """p ranks as threads; ``exchange`` hands every rank a copy of what every rank posted."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._posted: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._posted[rank] = tensor.clone()
        self._barrier.wait()
        everyone = [posted for posted in self._posted if posted is not None]
        self._barrier.wait()  # nobody posts the next message before everyone has read this one
        return everyone

    def abort(self) -> None:
        self._barrier.abort()


class ThreadTransport(TransportBase):
    """Raw hooks over a :class:`ThreadWorld`; records which hooks ran and which workspaces were asked for."""

    name = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(world.size, rank)
        self.world = world
        self.raw_calls: list[str] = []
        self.workspaces: list[str] = []

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self.raw_calls.append("all_to_all")
        everyone = self.world.exchange(self.rank, send)
        received.copy_(torch.cat([message.view(self.world_size, -1)[self.rank] for message in everyone]))

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        self.raw_calls.append("all_gather")
        received.copy_(torch.cat(self.world.exchange(self.rank, send)))

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        self.raw_calls.append("integer_all_reduce")
        everyone = self.world.exchange(self.rank, flat)
        total = everyone[0].to(torch.int64)
        for message in everyone[1:]:
            total = total + message.to(torch.int64)
        flat.copy_(total.to(flat.dtype))  # wraps around like an integer MPI_SUM / gloo SUM

    def _workspace(self, slot: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        self.workspaces.append(slot)
        return super()._workspace(slot, dtype, numel, device)


class _Deferred:
    """An issued collective that runs when waited for; its result buffer holds NaN / 0xEE bytes until then."""

    def __init__(self, run: Callable[[], None], result: torch.Tensor) -> None:
        self._run: Callable[[], None] | None = run
        if result.is_floating_point():
            result.fill_(float("nan"))
        else:
            result.view(torch.uint8).fill_(0xEE)

    def wait(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run()


class DeferredThreadTransport(ThreadTransport):
    """Issued collectives move data only when waited for (each rank must wait in issue order).

    ``issued`` records the issued collectives in order, ``waited`` how many were waited for.
    """

    name = "deferred-threads"
    supports_async = True

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(world, rank)
        self.issued: list[str] = []

    def _defer(self, name: str, run: Callable[[], None], result: torch.Tensor) -> _Deferred:
        self.issued.append(name)
        return _Deferred(run, result)

    def _raw_all_to_all_async(self, send: torch.Tensor, received: torch.Tensor) -> Any:
        return self._defer("all_to_all", lambda: self._raw_all_to_all(send, received), received)

    def _raw_all_gather_async(self, send: torch.Tensor, received: torch.Tensor) -> Any:
        return self._defer("all_gather", lambda: self._raw_all_gather(send, received), received)

    def _raw_integer_all_reduce_sum_async(self, flat: torch.Tensor) -> Any:
        # In place: the library owns the buffer until the wait and may write into it at any time; the
        # caller finds garbage there (a copy of what was sent is what travels).
        sent = flat.clone()

        def run() -> None:
            self._raw_integer_all_reduce_sum(sent)
            flat.copy_(sent)

        return self._defer("integer_all_reduce", run, flat)


def on_every_rank(
    p: int,
    run: Callable[[Any], Any],
    transport_type: type[ThreadTransport] = ThreadTransport,
) -> list[Any]:
    """``run(transport)`` on p thread ranks; the results in rank order (an exception on any rank is re-raised)."""
    world = ThreadWorld(p)
    results: list[Any] = [None] * p
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = run(transport_type(world, rank))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)
            world.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(p)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class ThreadLionCub(LionCub):
    """LionCub whose collectives go over a given transport (a thread world) instead of a process group;
    with ``overlap``, the votes started during backward go over that transport's ``overlap`` attribute."""

    def __init__(self, transport: Transport, *args: Any, **kwargs: Any) -> None:
        self._given_transport = transport
        super().__init__(*args, **kwargs)

    def _make_transport(self, process_group: Any) -> Transport:
        return self._given_transport

    def _voter_ranks(self) -> list[int]:
        return list(range(self._given_transport.world_size))

    def _make_overlap_transport(self, ranks: list[int]) -> Transport:
        overlap: Transport = self._given_transport.overlap  # type: ignore[attr-defined]
        return overlap
