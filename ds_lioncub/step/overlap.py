"""Votes started during backward: each bucket's message leaves as soon as its gradients are accumulated.

:class:`OverlapController` is option ``overlap``'s machinery beside the optimizer: a second process
group of the voters with its own vote, a gradient hook on every parameter, and the
:class:`ArmedBackward` of the backward pass that ``LionCub.overlap_next_backward`` armed. An armed
backward's bucket plan runs in reverse parameter order, the order in which backward finishes
gradients. A gradient hook marks a parameter ready; every bucket whose parameters are all ready, and
all of whose predecessors in the plan have left, is packed from the momentum and the gradient as they
are now and its first collective issued over the overlap transport, a process group of its own.
Buckets therefore leave in plan order on every rank, whenever each rank's backward gets there, and no
other collective on that group can come between them in a different order. Only reads happen here: the
momentum is updated at ``step()``, after the ranks agree the step can be taken.

The messages are a guess: clipping, loss-scale unscaling or user code may change the gradients
after backward. The step therefore packs every bucket again from the final gradients and compares
(:func:`ds_lioncub.step.paths.overlapped_rounds`; docs/design.md section 9.2).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_lioncub.aggregation import Aggregator, Bucket, build_aggregation
from ds_lioncub.comm.quantize import tie_sign
from ds_lioncub.comm.transport import CommStats, Transport
from ds_lioncub.comm.transport.torch_dist import process_group_timeout
from ds_lioncub.comm.votes import PendingAggregate
from ds_lioncub.config import LionCubConfig
from ds_lioncub.errors import LionCubConfigError, LionCubSetupError
from ds_lioncub.step.bucket_plan import Piece, plan_buckets
from ds_lioncub.step.bucket_work import Entry, bucket_directions, mean_abs_direction


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


class OverlapController:
    """Option ``overlap``: the vote over a second group of the voters, the gradient hooks, the armed backward.

    Owned by the optimizer. :meth:`set_up` runs at construction and on every re-binding to a process
    group; :meth:`arm` arms the next backward (``LionCub.overlap_next_backward``); the step takes the
    armed backward with :meth:`take_armed` and runs it (:func:`ds_lioncub.step.paths.overlapped_rounds`).
    """

    def __init__(self) -> None:
        #: The vote over the overlap transport (None: overlap off, or a world of one).
        self.vote: Aggregator | None = None
        #: The global ranks of the overlap vote's group.
        self.ranks: list[int] = []
        #: The backward armed and not yet stepped.
        self.armed: ArmedBackward | None = None
        #: Buckets launched from gradient hooks before step(), and those voted again at step() because
        #: some rank's final message differed (counts, for diagnosis).
        self.buckets_launched_in_backward = 0
        self.revoted_buckets = 0
        self._hooked_params: list[torch.Tensor] = []
        self._hook_handles: list[Any] = []

    def set_up(
        self,
        options: LionCubConfig,
        world_size: int,
        ranks: list[int],
        make_overlap_transport: Callable[[list[int]], Transport],
        params: list[torch.Tensor],
    ) -> None:
        """The vote over ``make_overlap_transport(ranks)`` (:func:`overlap_transport`: a new group of the
        voters, global ``ranks``) and a gradient hook on every one of ``params`` (once), when
        ``options.overlap`` is on and there is more than one voter."""
        self.armed = None
        if not options.overlap or world_size == 1:
            self.vote = None  # alone there is nothing to hide: steps run as without overlap
            return
        if self.vote is None or self.ranks != ranks:
            # Re-binding to a group of the same ranks (DeepSpeed's data-parallel group over the whole world)
            # keeps the group made at construction: a second one would only cost a communicator.
            vote = build_aggregation(options, make_overlap_transport(ranks), False)
            # The config admits overlap with compression only: every vote serves it.
            assert vote is not None and vote.votes_during_backward, f"overlap needs a vote, not {vote!r}"
            self.vote = vote
            self.ranks = ranks
        if not self._hook_handles:
            # The parameters backward accumulates into, by flat position: a mixed-precision wrapper later
            # puts fp32 copies in their place in the optimizer, but backward keeps filling these.
            self._hooked_params = params
            # The hooks hold the controller weakly (a model must not keep a dropped optimizer's momenta
            # and process groups alive) and are removed when it is collected.
            owner = weakref.ref(self)
            self._hook_handles = [
                param.register_post_accumulate_grad_hook(functools.partial(_gradient_ready, owner))
                for param in params
                if param.requires_grad
            ]
            weakref.finalize(self, _remove_hooks, list(self._hook_handles))

    def arm(
        self,
        param_groups: list[dict[str, Any]],
        state: Mapping[torch.Tensor, dict[str, Any]],
        positive_ties: bool,
        bucket_size: int,
    ) -> None:
        """Arm the next backward: its buckets' votes start from the gradient hooks (see
        ``LionCub.overlap_next_backward``). Drops the votes of an earlier armed backward first."""
        self.discard()
        vote = self.vote
        if vote is None:
            return
        flat = [(group, param) for group in param_groups for param in group["params"]]
        if len(flat) != len(self._hooked_params):
            raise LionCubSetupError(
                f"LionCub: overlap=True hooked {len(self._hooked_params)} parameters at construction, but the "
                f"optimizer now holds {len(flat)}; parameter groups cannot change when overlap is on."
            )
        # (group, the parameter stepped, the parameter backward fills) of each taking part
        taking_part = [(*flat[i], self._hooked_params[i]) for i in range(len(flat)) if _takes_part(flat[i][1])]
        params = [param for _, param, _ in taking_part]
        # Reverse parameter order: backward finishes the last layers' gradients first.
        last = len(params) - 1
        reverse_plan = plan_buckets([param.numel() for param in reversed(params)], bucket_size)
        plan = [
            [Piece(last - piece.tensor_index, piece.start, piece.length) for piece in bucket] for bucket in reverse_plan
        ]
        whole_mean_abs: dict[int, torch.Tensor] = {}

        def bucket_now(k: int) -> Bucket:
            # The gradients as they are now (None: zeros, as at step) and the momentum before this step's update.
            entries = {piece.tensor_index: _entry_now(state, *taking_part[piece.tensor_index]) for piece in plan[k]}
            if vote.needs_whole_tensor_mean_abs:
                for piece in plan[k]:
                    entry = entries[piece.tensor_index]
                    if entry.param.numel() > bucket_size and piece.tensor_index not in whole_mean_abs:
                        whole_mean_abs[piece.tensor_index] = mean_abs_direction(entry, bucket_size)
            values = torch.empty(sum(piece.length for piece in plan[k]), dtype=torch.float32, device=params[0].device)
            return bucket_directions(entries, plan[k], values, whole_mean_abs, vote)

        filled = [hooked for _, _, hooked in taking_part]
        self.armed = ArmedBackward(plan, filled, params, vote, positive_ties, bucket_now)

    def discard(self) -> None:
        """Wait for and drop the votes of an armed backward whose step will not come (collective)."""
        armed, self.armed = self.armed, None
        if armed is not None:
            armed.drain()

    def take_armed(self) -> ArmedBackward | None:
        """The armed backward, for the step that uses its votes (None if none); counts its early launches."""
        armed, self.armed = self.armed, None
        if armed is not None:
            self.buckets_launched_in_backward += len(armed.launched)
        return armed

    def traffic(self) -> CommStats:
        """What the overlap transport has sent so far (nothing without an overlap vote)."""
        return self.vote.transport.stats if self.vote is not None else CommStats()

    def arm_next_backward(
        self, options: LionCubConfig, param_groups: list[dict[str, Any]], state: Mapping[torch.Tensor, dict[str, Any]]
    ) -> None:
        """:meth:`ds_lioncub.LionCub.overlap_next_backward`: :meth:`arm` for the next step, refused without option
        ``overlap``."""
        if not options.overlap:
            raise LionCubConfigError(
                "LionCub: overlap_next_backward() starts votes during backward, which needs the option overlap=True; "
                "construct LionCub with overlap=True or drop the call."
            )
        positive_ties = tie_sign(param_groups[0]["step"] + 1, options.tie_break) > 0
        self.arm(param_groups, state, positive_ties, options.bucket_size)


def overlap_transport(
    ranks: list[int], make_transport: Callable[[dist.ProcessGroup], Transport], device: torch.device
) -> Transport:
    """A transport over a new process group of the voters (global ``ranks``): launches from gradient
    hooks may come before or after other collectives of the voters' group (DeepSpeed's, the finite
    check), in an order that differs between ranks, so they get a group of their own. Only the
    voters call this. The group waits for a silent peer as long as the default group does."""
    # The same kind of transport as the votes' (the config admits overlap with comm_backend_name "torch" only).
    group = dist.new_group(ranks=ranks, timeout=process_group_timeout(), use_local_synchronization=True)
    transport = make_transport(group)
    # One tiny collective now, while every voter is here: NCCL creates a group's communicator at its
    # first collective and blocks the host until all ranks join, which inside a gradient hook could
    # wait on a rank that is itself waiting in another group's collective.
    with transport.uncounted():  # set-up traffic, left out of comm_stats()
        transport.all_reduce_sum(torch.zeros(1, dtype=torch.int32, device=device))
    return transport


def _entry_now(
    state: Mapping[torch.Tensor, dict[str, Any]], group: dict[str, Any], param: torch.Tensor, filled: torch.Tensor
) -> Entry:
    """``param`` with the gradient backward accumulated into ``filled`` (``param`` itself, or the
    low-precision parameter it is a copy of: converted exactly) and its momentum, creating neither
    (zeros stand in for both)."""
    grad = filled.grad
    grad = torch.zeros_like(param) if grad is None else grad.to(param.dtype)
    exp_avg = state[param].get("exp_avg") if param in state else None
    return Entry(group, param, grad, exp_avg if exp_avg is not None else torch.zeros_like(param))


def _takes_part(param: torch.Tensor) -> bool:
    """Whether ``param`` takes part in steps (with a gradient, or as zeros on a rank without one)."""
    return param.requires_grad and param.numel() > 0


def _gradient_ready(owner: weakref.ref[OverlapController], param: torch.Tensor) -> None:
    """A parameter's gradient hook: hand the accumulated gradient to the owner's armed backward, if any."""
    controller = owner()
    if controller is not None and controller.armed is not None:
        controller.armed.gradient_ready(param)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["ArmedBackward", "LaunchedBucket", "OverlapController", "overlap_transport"]
