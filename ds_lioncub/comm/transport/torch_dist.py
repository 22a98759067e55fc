"""The transport over a torch.distributed process group (gloo on CPU, NCCL on GPU).

deepspeed.comm initialises the same default group, so this transport also serves DeepSpeed jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport.base import TransportBase, Waitable, torch_distributed_initialised
from ds_lioncub.comm.transport.released import HandedOver

# gloo moves one message of several MB between two ranks that both send at about half the link rate,
# and the same bytes as a run of messages of about 1 MiB at 0.9 of it or more (benchmarks/RESULTS.md,
# "The 1-bit vote in pipeline chunks"), so on gloo the all-to-alls and all-gathers above this go out in
# segments.
GLOO_SEGMENT_BYTES = 1 << 20


def process_group_timeout(process_group: dist.ProcessGroup | None = None) -> timedelta | None:
    """How long a collective of ``process_group`` (``None``: the default group) waits for a silent peer
    before it fails: the ``timeout`` the group was created with. ``None`` where torch.distributed is
    not initialised or the backend does not say.

    Groups LionCub creates pass the default group's timeout on: ``new_group`` without one gets the
    backend's own default (30 min on gloo, 10 min on NCCL), not what ``init_process_group(timeout=...)``
    or ``deepspeed.init_distributed(timeout=...)`` set.
    """
    if not torch_distributed_initialised(process_group):
        return None
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without readable options (torch builds differ)
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


class _Released:
    """Collectives issued together (one, or the segments of one): ``wait()`` waits for each in issue order,
    then until the backend's worker threads have let go of the tensors they were handed (:mod:`.released`),
    then reassembles the result, if it was segmented."""

    def __init__(
        self, works: list[Waitable], handed: list[HandedOver], reassemble: Callable[[], None] | None = None
    ) -> None:
        self._works = works
        self._handed = handed
        self._reassemble = reassemble

    def wait(self) -> None:
        works, self._works = self._works, []
        while works:
            works.pop(0).wait()
        # No reference to a work is left here (a loop variable would keep the last one, and with it its
        # tensors): gloo's worker may now hold the only ones, and lets go of them during this wait.
        for handed in self._handed:
            handed.wait_until_released()
        self._handed = []
        if self._reassemble is not None:
            reassemble, self._reassemble = self._reassemble, None
            reassemble()


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch,
# which setup.py still admits, has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport(TransportBase):
    """Collectives over a torch.distributed process group (``None``: the default group).

    Without an initialised process group it is a world of one, where every collective is a copy
    and nothing is counted as sent. Issued collectives (``start_*``) run with ``async_op=True``: gloo
    progresses them on its own threads, NCCL on its stream.

    ``segment_bytes``: on gloo (CPU tensors), an all-to-all or all-gather moving more than this many
    bytes per rank runs as several collectives of at most about this size, all issued at once (the
    result is the same; the bytes counted are those of the one collective). ``None``, the default on
    every other backend (NCCL included), never segments.
    """

    name = "torch"
    supports_async = True

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.distributed = torch_distributed_initialised(process_group)
        world_size = dist.get_world_size(process_group) if self.distributed else 1
        rank = dist.get_rank(process_group) if self.distributed else 0
        super().__init__(world_size, rank)
        # "gloo", or gloo for CPU tensors in a group of several backends ("cpu:gloo,cuda:nccl").
        on_gloo = self.distributed and "gloo" in str(dist.get_backend(process_group))
        self.segment_bytes: int | None = GLOO_SEGMENT_BYTES if on_gloo else None

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        work = self._raw_all_to_all_async(send, received)
        if work is not None:
            work.wait()

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        work = self._raw_all_gather_async(send, received)
        if work is not None:
            work.wait()

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        handed = HandedOver(flat)
        dist.all_reduce(handed.tensors[0], op=dist.ReduceOp.SUM, group=self.process_group)
        handed.wait_until_released()

    def _raw_all_to_all_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        columns = self._segment_columns(send, send.numel() // self.world_size, send.element_size() * self.world_size)
        if len(columns) <= 1:
            return self._issue(dist.all_to_all_single, [(received, send)])
        # Segment k carries columns [a, b) of every destination's row; its pieces land in the same columns.
        send_rows, received_rows = send.view(self.world_size, -1), received.view(self.world_size, -1)
        pieces = []
        for begin, end in columns:
            piece_sent = send_rows[:, begin:end].contiguous()
            pieces.append((begin, end, torch.empty_like(piece_sent), piece_sent))

        def reassemble() -> None:
            for begin, end, piece_received, _ in pieces:
                received_rows[:, begin:end].copy_(piece_received)

        pairs = [(piece_received, piece_sent) for _, _, piece_received, piece_sent in pieces]
        return self._issue(dist.all_to_all_single, pairs, reassemble)

    def _raw_all_gather_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        columns = self._segment_columns(send, send.numel(), send.element_size())
        if len(columns) <= 1:
            return self._issue(_all_gather_flat, [(received, send)])
        # Segment k gathers elements [a, b) of every rank's message; they land at [a, b) of each rank's row.
        received_rows = received.view(self.world_size, -1)
        pieces = [(begin, end, send.new_empty((self.world_size, end - begin))) for begin, end in columns]

        def reassemble() -> None:
            for begin, end, piece_received in pieces:
                received_rows[:, begin:end].copy_(piece_received)

        pairs = [(piece.view(-1), send[begin:end]) for begin, end, piece in pieces]
        return self._issue(_all_gather_flat, pairs, reassemble)

    def _issue(
        self,
        collective: Callable[..., Waitable],
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        reassemble: Callable[[], None] | None = None,
    ) -> _Released:
        """``collective(received, sent)`` for each pair, all issued, on private views (:class:`HandedOver`)."""
        handed, works = [], []
        for received, sent in pairs:
            handed.append(HandedOver(received, sent))
            received_view, sent_view = handed[-1].tensors
            works.append(collective(received_view, sent_view, group=self.process_group, async_op=True))
        return _Released(works, handed, reassemble)

    def _segment_columns(self, send: torch.Tensor, columns: int, bytes_per_column: int) -> list[tuple[int, int]]:
        """``[a, b)`` column ranges of at most about ``segment_bytes`` each; one range for a message that
        is small, not on the CPU (gloo carries CPU tensors), or when not segmenting."""
        if self.segment_bytes is None or send.device.type != "cpu" or columns * bytes_per_column <= self.segment_bytes:
            return [(0, columns)]
        step = max(1, self.segment_bytes // bytes_per_column)
        return [(begin, min(columns, begin + step)) for begin in range(0, columns, step)]

    def _raw_integer_all_reduce_sum_async(self, flat: torch.Tensor) -> Waitable | None:
        handed = HandedOver(flat)
        work = dist.all_reduce(handed.tensors[0], op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        return _Released([work], [handed])
