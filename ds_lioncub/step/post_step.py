"""What runs after an optimizer step: momentum sync and the replica check, as post-step hooks.

A rank's step (:class:`~ds_lioncub.step.rank_step.RankStep`) runs every hook of its ``post_step_hooks`` list, in
order, after the step's update and step count, before the step ends (so their traffic is the step's). A hook is
any callable taking a :class:`StepDone` and giving its rounds (:mod:`ds_lioncub.step.rounds`: a generator that
yields after issuing a collective and before reading it); each decides for itself whether this step is one of its
steps. A new per-step duty is a new hook, not a new branch in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ds_lioncub.aggregation import COMM_DTYPES, Bucket, ExactMean
from ds_lioncub.comm.transport import Transport
from ds_lioncub.config import ConsistencyCheckConfig, MomentumSyncConfig
from ds_lioncub.consistency.replica_check import check_replicas
from ds_lioncub.step.bucket_plan import plan_buckets
from ds_lioncub.step.bucket_work import piece_of
from ds_lioncub.step.param_selection import select_parameters


@dataclass(frozen=True)
class StepDone:
    """What a post-step hook sees of the optimizer after step ``step``.

    Attributes:
        step: the optimizer step just taken (1-based).
        params: every parameter, by flat position (group order, then parameter order).
        names: their names by flat position, or None when some parameter has none.
        momenta: this rank's momentum (``exp_avg``) of each parameter by flat position (None: none yet).
        transport: the voters' group.
        agreement: the ranks that must raise together (the voters, or the whole world under ZeRO hybrid).
        params_are_replicas: whether the voters hold the same parameters (not so when ZeRO partitions them).
        bucket_size: elements per bucket (option ``bucket_size``).
    """

    step: int
    params: list[torch.Tensor]
    names: list[str] | None
    momenta: list[torch.Tensor | None]
    transport: Transport
    agreement: Transport
    params_are_replicas: bool
    bucket_size: int


PostStepHook = Callable[[StepDone], Iterator[None]]


class MomentumSync:
    """Average ``exp_avg`` of the selected layers over the voters every ``interval`` steps (option
    ``momentum_sync``): the selection by flat position, made by :meth:`select` whenever names change."""

    def __init__(self, options: MomentumSyncConfig) -> None:
        self.options = options
        #: The flat positions of the parameters whose momentum is averaged.
        self.positions: set[int] = set()

    def select(self, params: list[torch.Tensor], names: list[str] | None, module: nn.Module | None) -> None:
        """Choose the parameters by ``options.layers`` (names from named params or ``module``)."""
        if self.options.interval == 0:
            return
        selected = select_parameters(params, names, self.options.layers, module)
        self.positions = {position for position, chosen in enumerate(selected) if chosen}

    def __call__(self, done: StepDone) -> Iterator[None]:
        """Every selected parameter that has a momentum, whether or not it took part in this step: per bucket, the
        mean's collective issued (a round), then the mean copied back."""
        interval = self.options.interval
        if not interval or done.step % interval != 0 or done.transport.world_size == 1:
            return
        momenta = [
            momentum
            for position, momentum in enumerate(done.momenta)
            if position in self.positions and momentum is not None
        ]
        mean = ExactMean(done.transport, COMM_DTYPES[self.options.dtype])
        for bucket in plan_buckets([m.numel() for m in momenta], done.bucket_size):
            slices = [piece_of(momenta[piece.tensor_index], piece) for piece in bucket]
            sizes = [piece.length for piece in bucket]
            pending = mean.start(Bucket(torch.cat(slices), sizes, []))
            yield
            for target, value in zip(slices, mean.finish(pending).split(sizes), strict=True):
                target.copy_(value)


class ReplicaCheck:
    """Every ``interval`` steps, raise the same error on every rank if the voters' parameters differ
    (option ``consistency_check``; :func:`ds_lioncub.consistency.replica_check.check_replicas`). Runs only where
    the voters hold replicas."""

    def __init__(self, options: ConsistencyCheckConfig) -> None:
        self.options = options

    def __call__(self, done: StepDone) -> Iterator[None]:
        """One blocking collective round of its own (the virtual world, whose workers share one copy of the
        parameters, refuses the option)."""
        interval = self.options.interval
        if not interval or done.step % interval != 0 or not done.params_are_replicas:
            return iter(())
        if done.names:
            labels = [repr(name) for name in done.names]
        else:
            labels = [f"parameter #{i} of shape {tuple(p.shape)}" for i, p in enumerate(done.params)]
        check_replicas(done.transport, done.params, labels, done.step, agreement=done.agreement)
        return iter(())


__all__ = ["MomentumSync", "PostStepHook", "ReplicaCheck", "StepDone"]
