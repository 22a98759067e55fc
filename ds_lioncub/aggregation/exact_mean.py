"""The exact mean of the ranks' tensors: what exact Lion and momentum sync average with."""

from __future__ import annotations

import torch

from ds_lioncub.aggregation.state import Bucket, ExactMeanState
from ds_lioncub.comm.transport import Transport
from ds_lioncub.comm.votes import PendingAggregate

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExactMean:
    """The mean of the ranks' tensors: one all-reduce per bucket in ``comm_dtype``, rounded back to fp32.

    Exact Lion averages gradients with it; momentum sync averages momenta. The sum runs in rank
    order (see :mod:`ds_lioncub.comm.transport`), so every rank gets the same bits.

    Tuning: see :class:`ExactMeanState` (``comm_dtype``). It takes no vote, so it answers no for packed
    signs and for overlap, and refuses the vote-only calls (:meth:`pack`, :meth:`issue`,
    :meth:`sign_message_layout`, :meth:`complete_packed`, :meth:`tied_counts`).
    """

    reduces_gradients = True
    needs_whole_tensor_mean_abs = False

    def __init__(self, transport: Transport, comm_dtype: torch.dtype = torch.float32) -> None:
        self.transport = transport
        self.state = ExactMeanState(comm_dtype)

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.state.comm_dtype

    def start(self, bucket: Bucket, positive_ties: bool = True) -> torch.Tensor:
        """The rank-order sum of the bucket in ``comm_dtype`` (no ties: nothing is signed), run to the end:
        its reduction is local work between two collectives."""
        self.state.issued += 1
        return self.transport.all_reduce_sum(bucket.values.to(self.comm_dtype))

    @property
    def votes_packed_signs(self) -> bool:
        return False

    @property
    def votes_during_backward(self) -> bool:
        return False

    @property
    def agrees_before_start(self) -> bool:
        return False

    def agree(self, bucket: Bucket) -> None:
        """Nothing to agree: the mean is one all-reduce."""

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        raise self._no_vote("pack")

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        raise self._no_vote("issue")

    def sign_message_layout(self, numel: int) -> tuple[int, int]:
        raise self._no_vote("sign_message_layout")

    def complete_packed(self, result: object) -> torch.Tensor:
        raise self._no_vote("complete_packed")

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        raise TypeError(f"count_tied_votes: {type(self).__name__} takes no vote")

    def _no_vote(self, call: str) -> ValueError:
        return ValueError(f"{call} is for votes, not {self!r}")

    def __repr__(self) -> str:
        return f"ExactMean(comm_dtype={self.comm_dtype})"

    def reduce(self, pending: object) -> object:
        return pending

    def complete(self, result: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean in fp32, into ``out`` when given."""
        assert isinstance(result, torch.Tensor)
        mean = result.float().div_(self.transport.world_size)
        return mean if out is None else out.copy_(mean)

    def finish(self, pending: object, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.complete(self.reduce(pending), out)
