"""The transport over a torch.distributed process group (gloo on CPU, NCCL on GPU).

deepspeed.comm initialises the same default group, so this transport also serves DeepSpeed jobs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_lioncub.comm.transport.base import TransportBase, Waitable, torch_distributed_initialised

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch,
# which setup.py still admits, has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport(TransportBase):
    """Collectives over a torch.distributed process group (``None``: the default group).

    Without an initialised process group it is a world of one, where every collective is a copy
    and nothing is counted as sent. Issued collectives (``start_*``) run with ``async_op=True``: gloo
    progresses them on its own threads, NCCL on its stream.
    """

    name = "torch"
    supports_async = True

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.distributed = torch_distributed_initialised(process_group)
        world_size = dist.get_world_size(process_group) if self.distributed else 1
        rank = dist.get_rank(process_group) if self.distributed else 0
        super().__init__(world_size, rank)

    def _raw_all_to_all(self, send: torch.Tensor, received: torch.Tensor) -> None:
        dist.all_to_all_single(received, send, group=self.process_group)

    def _raw_all_gather(self, send: torch.Tensor, received: torch.Tensor) -> None:
        _all_gather_flat(received, send, group=self.process_group)

    def _raw_integer_all_reduce_sum(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)

    def _raw_all_to_all_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        return dist.all_to_all_single(received, send, group=self.process_group, async_op=True)

    def _raw_all_gather_async(self, send: torch.Tensor, received: torch.Tensor) -> Waitable | None:
        return _all_gather_flat(received, send, group=self.process_group, async_op=True)

    def _raw_integer_all_reduce_sum_async(self, flat: torch.Tensor) -> Waitable | None:
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
