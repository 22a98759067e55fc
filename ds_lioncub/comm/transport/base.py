"""What every transport shares: the interface, the traffic counters, and the collectives' common logic.

:class:`TransportBase` implements the public collectives once. It handles the world of one (a copy,
nothing counted), the byte accounting (:mod:`ds_lioncub.comm.wire`), and the floating-point sum in
rank order. A subclass supplies only the raw data movement: ``_raw_all_to_all``, ``_raw_all_gather``
and ``_raw_integer_all_reduce_sum``, and, where its library can leave a collective running, their
``_async`` variants.

Every collective exists twice: blocking (``all_to_all``: the result) and issued (``start_all_to_all``:
an :class:`InFlight` whose result :meth:`TransportBase.wait` returns). Both count the same bytes when
issued. A transport without non-blocking collectives (``supports_async`` False) runs ``start_*``
to completion before returning, so callers are correct on every transport and overlap only where
the library allows it.

Internal steps call the raw hooks, never the public methods. Benchmarks time a transport by
replacing its public methods on the instance; a float sum that went through the public
``all_to_all`` would then be timed twice and counted three times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from ds_lioncub.comm import wire
from ds_lioncub.errors import LionCubConfigError


@dataclass
class CommStats:
    """Cumulative traffic of one rank: collectives issued, payload bytes sent / received, seconds inside them.

    ``seconds`` is host wall-clock time (``time.perf_counter``) from entering a collective's data
    movement to its return, the rank-order float sum's additions included. It is left out of ``==``:
    two runs move the same bytes but never take the same time.
    """

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = field(default=0.0, compare=False)

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(
            self.collectives - other.collectives,
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
            self.seconds - other.seconds,
        )

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(
            self.collectives + other.collectives,
            self.bytes_sent + other.bytes_sent,
            self.bytes_received + other.bytes_received,
            self.seconds + other.seconds,
        )


#: The public methods that communicate or wait for communication: what a benchmark replaces on an
#: instance to time a transport's collectives (each call runs exactly one of them).
COMMUNICATING_METHODS = (
    "all_to_all",
    "all_gather",
    "all_reduce_sum",
    "start_all_to_all",
    "start_all_gather",
    "start_all_reduce_sum",
    "wait",
)


class Waitable(Protocol):
    """What a library hands back for a collective left running (torch.distributed's ``Work``)."""

    def wait(self) -> object: ...


class InFlight:
    """A collective that has been issued and may still be running; :meth:`Transport.wait` gives its result.

    It keeps the message it sent alive until then: the library may still be reading it. ``copy_back``
    (a tensor) receives the result when it is waited for, for a collective that ran on a contiguous
    copy of its caller's tensor.
    """

    def __init__(
        self,
        result: torch.Tensor,
        work: Waitable | None = None,
        sent: torch.Tensor | None = None,
        copy_back: torch.Tensor | None = None,
    ) -> None:
        self._result = result
        self._work = work
        self._sent = sent
        self._copy_back = copy_back

    @property
    def device(self) -> torch.device:
        """Where the result will be."""
        return self._result.device

    def _complete(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._sent = None
        if self._copy_back is not None:
            self._result = self._copy_back.copy_(self._result)
            self._copy_back = None
        return self._result


class Transport(Protocol):
    """What CompressedBackend and LionCub need from a transport."""

    name: str
    world_size: int
    rank: int
    stats: CommStats
    #: Whether ``start_*`` can return before the collective is done (otherwise they block).
    supports_async: bool

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, send: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def start_all_to_all(self, send: torch.Tensor) -> InFlight: ...

    def start_all_gather(self, send: torch.Tensor) -> InFlight: ...

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> InFlight: ...

    def wait(self, pending: InFlight) -> torch.Tensor: ...

    def uncounted(self) -> AbstractContextManager[None]: ...


def sum_rows_in_rank_order(rows: torch.Tensor) -> torch.Tensor:
    """((row0 + row1) + row2) + ...: each rank's contribution to one chunk, summed in rank order.

    fp32/fp64 add in place into ``rows[0]``; fp16/bf16 accumulate in fp32 and round once. Every
    transport reduces floating point this way, so their results agree bit for bit.
    """
    if rows.dtype in (torch.float32, torch.float64):
        total = rows[0]
        for row in rows[1:]:
            total.add_(row)
        return total
    accumulated = rows[0].float()
    for row in rows[1:]:
        accumulated.add_(row)
    return accumulated.to(rows.dtype)


def torch_distributed_initialised(process_group: dist.ProcessGroup | None) -> bool:
    """Whether torch.distributed is initialised; raises if ``process_group`` was given without it."""
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialised:
        raise LionCubConfigError(
            "LionCub: a process_group was given but torch.distributed is not initialised. Initialise it first "
            "(deepspeed.init_distributed() or torch.distributed.init_process_group()), or pass process_group=None."
        )
    return initialised


class TransportBase:
    """The public collectives over a subclass's raw hooks, with the world of one and the byte accounting.

    Subclasses set ``name`` and call ``__init__`` with their world size and rank. The hooks get
    flat contiguous tensors, already checked, and never run at world size 1:

    - ``_raw_all_to_all(send, received)``: chunk j of ``send`` goes to rank j; ``received`` holds
      the chunks from ranks 0..p-1 in order.
    - ``_raw_all_gather(send, received)``: ``received`` is every rank's ``send`` in rank order.
    - ``_raw_integer_all_reduce_sum(flat)``: in-place elementwise sum of an integer tensor.
    - ``_workspace(slot, dtype, numel, device)``: scratch memory for the float sum (default: a new
      tensor each call; a subclass may reuse buffers per ``slot``).
    - ``_check_sum_dtype(dtype)``: raise for dtypes the transport cannot sum (default: accept all).
    - ``_raw_all_to_all_async``, ``_raw_all_gather_async``, ``_raw_integer_all_reduce_sum_async``: the
      same, issued without waiting, returning what to wait on (default: the blocking hook, then None).
      A subclass that overrides them sets ``supports_async = True``.

    Collectives issued with ``start_*`` must be issued in the same order on every rank (the
    libraries match them by issue order per group); when they are waited for does not matter.
    """

    name: str
    supports_async = False

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size = world_size
        self.rank = rank
        self.stats = CommStats()

    # ------------------------------------------------------------------ public collectives

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Rank j receives chunk j of every rank's ``send`` (numel divisible by p), rank-major, shaped like ``send``."""
        if self.world_size == 1:
            return send.clone()
        flat, received = self._all_to_all_buffers(send)
        started = time.perf_counter()
        self._raw_all_to_all(flat, received)
        self._count(wire.all_to_all_bytes(_nbytes(send), self.world_size), time.perf_counter() - started)
        return received.view(send.shape)

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``send``, in rank order, as one flat tensor."""
        if self.world_size == 1:
            return send.clone()
        flat = send.contiguous().view(-1)
        received = flat.new_empty(flat.numel() * self.world_size)
        started = time.perf_counter()
        self._raw_all_gather(flat, received)
        self._count(wire.all_gather_bytes(_nbytes(send), self.world_size), time.perf_counter() - started)
        return received

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place elementwise sum over ranks, returned; floats in rank order (see :meth:`_ordered_float_sum`)."""
        return self._all_reduce_sum(tensor)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        self._check_sum_dtype(tensor.dtype)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        started = time.perf_counter()
        if tensor.is_floating_point():
            self._ordered_float_sum(flat)
        else:
            self._raw_integer_all_reduce_sum(flat)
        seconds = time.perf_counter() - started
        if work is not tensor:
            tensor.copy_(work)
        self._count(wire.all_reduce_bytes(_nbytes(tensor), self.world_size), seconds)
        return tensor

    # ------------------------------------------------------------------ issued collectives

    def start_all_to_all(self, send: torch.Tensor) -> InFlight:
        """:meth:`all_to_all`, issued: its result once :meth:`wait` returns. Counted now."""
        if self.world_size == 1:
            return InFlight(send.clone())
        flat, received = self._all_to_all_buffers(send)
        started = time.perf_counter()
        work = self._raw_all_to_all_async(flat, received)
        self._count(wire.all_to_all_bytes(_nbytes(send), self.world_size), time.perf_counter() - started)
        return InFlight(received.view(send.shape), work, sent=flat)

    def start_all_gather(self, send: torch.Tensor) -> InFlight:
        """:meth:`all_gather`, issued: its result once :meth:`wait` returns. Counted now."""
        if self.world_size == 1:
            return InFlight(send.clone())
        flat = send.contiguous().view(-1)
        received = flat.new_empty(flat.numel() * self.world_size)
        started = time.perf_counter()
        work = self._raw_all_gather_async(flat, received)
        self._count(wire.all_gather_bytes(_nbytes(send), self.world_size), time.perf_counter() - started)
        return InFlight(received, work, sent=flat)

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> InFlight:
        """:meth:`all_reduce_sum`, issued: ``tensor`` holds the sum once :meth:`wait` returns it. Counted now.

        Integer sums are left running; a floating-point sum runs to completion here, because its
        rank-order reduction is local work between two collectives (the votes sum integers only).
        """
        if self.world_size == 1 or tensor.is_floating_point():
            return InFlight(self._all_reduce_sum(tensor))
        self._check_sum_dtype(tensor.dtype)
        work_tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        started = time.perf_counter()
        work = self._raw_integer_all_reduce_sum_async(work_tensor.view(-1))
        self._count(wire.all_reduce_bytes(_nbytes(tensor), self.world_size), time.perf_counter() - started)
        return InFlight(work_tensor, work, copy_back=None if work_tensor is tensor else tensor)

    def wait(self, pending: InFlight) -> torch.Tensor:
        """The result of an issued collective, once it is done on this rank (at once if it already is).

        The seconds spent waiting count as seconds inside collectives (``stats.seconds``), as the
        issue's own did: together, the part of the collective this rank did not overlap with other work.
        """
        if pending._work is None:  # finished when issued (a world of one, a blocking library): nothing to wait for
            return pending._complete()
        started = time.perf_counter()
        result = pending._complete()
        self.stats.seconds += time.perf_counter() - started
        return result

    # ------------------------------------------------------------------ shared internals

    def _all_to_all_buffers(self, send: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if send.numel() % self.world_size:
            raise ValueError(f"all_to_all: {send.numel()} elements do not split into {self.world_size} equal chunks")
        flat = send.contiguous().view(-1)
        return flat, torch.empty_like(flat)

    def _ordered_float_sum(self, flat: torch.Tensor) -> None:
        """Reduce-scatter by all-to-all, rank-order sum of each chunk on its owner, all-gather into ``flat``.

        It moves the bytes of a ring all-reduce (plus the padding to p equal chunks, which the
        counters leave out), and its result does not depend on the library's reduction order, so
        all transports agree bit for bit at any world size.
        """
        p, numel = self.world_size, flat.numel()
        if numel == 0:
            return
        chunk = math.ceil(numel / p)
        send = flat
        if chunk * p != numel:
            send = self._workspace("padded", flat.dtype, chunk * p, flat.device)
            send[:numel].copy_(flat)
            send[numel:].zero_()
        rows = self._workspace("rows", flat.dtype, chunk * p, flat.device)
        self._raw_all_to_all(send, rows)
        total = sum_rows_in_rank_order(rows.view(p, chunk))  # row r: rank r's values of this rank's chunk
        self._raw_all_gather(total, send)
        if send is not flat:
            flat.copy_(send[:numel])

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave the collectives of a ``with`` block out of ``stats``.

        ``stats`` (and so ``LionCub.comm_stats()`` and the telemetry) describes the training's traffic;
        set-up and bookkeeping exchanges (the same-set-up check, the node-size agreement, a new group's
        first collective, the telemetry's own tie count) run inside this block. The counters are put
        back as they were when the block ends, also when it raises.
        """
        counted = self.stats + CommStats()  # a copy: the collectives inside keep adding to self.stats
        try:
            yield
        finally:
            self.stats = counted

    def _count(self, moved: int, seconds: float) -> None:
        self.stats.collectives += 1
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
        self.stats.seconds += seconds

    # ------------------------------------------------------------------ hooks

    def _workspace(self, slot: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def _check_sum_dtype(self, dtype: torch.dtype) -> None:
        return None

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        raise NotImplementedError

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        raise NotImplementedError

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        raise NotImplementedError

    def _raw_all_to_all_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        self._raw_all_to_all(send, received)
        return None

    def _raw_all_gather_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        self._raw_all_gather(send, received)
        return None

    def _raw_integer_all_reduce_sum_async(self, flat: torch.Tensor) -> Waitable | None:
        self._raw_integer_all_reduce_sum(flat)
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
