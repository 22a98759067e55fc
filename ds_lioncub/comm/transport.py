"""Moving bytes between data-parallel ranks, and counting them.

A transport offers the three collectives the compressed backend needs. ``TorchTransport`` runs them
on a torch.distributed process group (gloo on CPU, NCCL on GPU; deepspeed.comm initialises the same
default group, so this also serves DeepSpeed jobs). Without an initialised process group it is a
world of one, where every collective is a copy and nothing is counted as sent.

Byte counts are what a bandwidth-optimal algorithm moves per rank (ring all-gather / all-to-all /
ring all-reduce), so they can be compared with the formulas in DESIGN.md and with the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Cumulative traffic of one rank: collectives issued and payload bytes sent / received."""

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(
            self.collectives - other.collectives,
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
        )


class TorchTransport:
    """Collectives over a torch.distributed process group (``None``: the default group)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.stats = CommStats()

    def _count(self, sent: int, received: int) -> None:
        self.stats.collectives += 1
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Rank j receives chunk j of every rank's ``send`` (numel divisible by p), rank-major."""
        if self.world_size == 1:
            return send.clone()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.process_group)
        moved = send.numel() * send.element_size() * (self.world_size - 1) // self.world_size
        self._count(moved, moved)
        return received

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``send``, in rank order."""
        if self.world_size == 1:
            return send.clone()
        received = send.new_empty(send.numel() * self.world_size)
        dist.all_gather_into_tensor(received, send.contiguous(), group=self.process_group)
        moved = send.numel() * send.element_size() * (self.world_size - 1)
        self._count(moved, moved)
        return received

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place elementwise sum over ranks."""
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        moved = 2 * tensor.numel() * tensor.element_size() * (self.world_size - 1) // self.world_size
        self._count(moved, moved)
        return tensor
