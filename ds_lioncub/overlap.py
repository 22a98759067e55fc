"""Votes started during backward: each bucket's message leaves as soon as its gradients are accumulated.

An :class:`ArmedBackward` belongs to one armed backward pass (``LionCub.overlap_next_backward``). Its
bucket plan runs in reverse parameter order, the order in which backward finishes gradients. A
gradient hook marks a parameter ready; every bucket whose parameters are all ready, and all of whose
predecessors in the plan have left, is packed from the momentum and the gradient as they are now and
its first collective issued over the overlap transport, a process group of its own. Buckets
therefore leave in plan order on every rank, whenever each rank's backward gets there, and no other
collective on that group can come between them in a different order. Only reads happen here: the
momentum is updated at ``step()``, after the ranks agree the step can be taken.

The messages are a guess: clipping, loss-scale unscaling or user code may change the gradients
after backward. ``LionCub.step`` therefore packs every bucket again from the final gradients and
compares (:meth:`ArmedBackward.sent_message`); see ``LionCub._overlapped_step`` and
docs/design.md section 9.2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_lioncub.aggregation import Aggregator, Bucket
from ds_lioncub.buckets import Piece
from ds_lioncub.comm.transport import CommStats
from ds_lioncub.comm.votes import PendingAggregate


@dataclass
class LaunchedBucket:
    """A bucket whose first collective is out: the message this rank sent and the collective."""

    message: torch.Tensor
    pending: PendingAggregate


class ArmedBackward:
    """The buckets of one armed backward, launched in plan order as their gradients become ready.

    Args:
        plan: buckets over ``filled`` (pieces index into it), in the order they are launched.
        filled: the parameters taking part, in the optimizer's flat order, as backward fills them
            (their gradient hooks report these).
        stepped: the same parameters as the optimizer steps them (fp32 copies under a mixed-precision
            wrapper, else ``filled``).
        vote: the aggregation over the overlap transport.
        positive_ties: the tie rule of the step these votes are for.
        pack_bucket: ``pack_bucket(k)`` makes bucket k's values (c from the momentum and the current
            gradients; a missing gradient counts as zeros) for ``vote.pack``.
    """

    def __init__(
        self,
        plan: list[list[Piece]],
        filled: list[torch.Tensor],
        stepped: list[torch.Tensor],
        vote: Aggregator,
        positive_ties: bool,
        pack_bucket: Callable[[int], Bucket],
    ) -> None:
        self.plan = plan
        self.plan_params = filled
        self.stepped = stepped
        self.vote = vote
        self.positive_ties = positive_ties
        self._pack_bucket = pack_bucket
        self._position = {id(param): index for index, param in enumerate(filled)}
        self._waiting_for = [{piece.tensor_index for piece in bucket} for bucket in plan]
        self._ready: set[int] = set()
        self.launched: list[LaunchedBucket] = []
        self._traffic_at_arming = vote.transport.stats + CommStats()  # a copy: the transport keeps counting

    def gradient_ready(self, param: torch.Tensor) -> None:
        """A gradient hook fired for ``param``: launch every bucket that is now complete, in plan order."""
        position = self._position.get(id(param))
        if position is None:
            return
        self._ready.add(position)
        self._launch_ready()

    def traffic_since_armed(self) -> CommStats:
        """What the overlap transport sent since this backward was armed (its launches so far)."""
        return self.vote.transport.stats - self._traffic_at_arming

    def flush(self) -> None:
        """Launch the buckets still waiting (parameters that got no gradient in this backward)."""
        self._ready.update(range(len(self.plan_params)))
        self._launch_ready()

    def drain(self) -> None:
        """Launch what is left and wait for every collective: the step will not use them.

        Every rank must drain together, as every rank must issue the same collectives.
        """
        self.flush()
        transport = self.vote.transport
        for launched in self.launched:
            transport.wait(launched.pending.received)
        self.launched = []

    def _launch_ready(self) -> None:
        while len(self.launched) < len(self.plan) and self._waiting_for[len(self.launched)] <= self._ready:
            k = len(self.launched)
            bucket = self._pack_bucket(k)
            message = self.vote.pack(bucket, self.positive_ties)
            # A copy travels: a k-bit all-reduce sums in place, and step() compares with what was sent.
            pending = self.vote.issue(message.clone(), bucket.values.numel(), self.positive_ties)
            self.launched.append(LaunchedBucket(message, pending))


__all__ = ["ArmedBackward", "LaunchedBucket"]
