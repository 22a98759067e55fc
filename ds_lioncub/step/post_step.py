"""What runs after an optimizer step: momentum sync and the replica check, as post-step hooks.

``LionCub.step`` calls every hook of its ``post_step_hooks`` list, in order, after the step's update
and step count, before the step's telemetry record closes (so their traffic is the step's). A hook is
any callable taking a :class:`StepDone`; each decides for itself whether this step is one of its steps.
A new per-step duty is a new hook, not a new branch in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
        state: the optimizer's per-parameter state (``exp_avg`` is the momentum).
        transport: the voters' group.
        agreement: the ranks that must raise together (the voters, or the whole world under ZeRO hybrid).
        params_are_replicas: whether the voters hold the same parameters (not so when ZeRO partitions them).
        bucket_size: elements per bucket (option ``bucket_size``).
    """

    step: int
    params: list[torch.Tensor]
    names: list[str] | None
    state: Mapping[torch.Tensor, dict[str, Any]]
    transport: Transport
    agreement: Transport
    params_are_replicas: bool
    bucket_size: int


PostStepHook = Callable[[StepDone], None]


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

    def __call__(self, done: StepDone) -> None:
        interval = self.options.interval
        if not interval or done.step % interval != 0 or done.transport.world_size == 1:
            return
        momenta = [
            done.state[p]["exp_avg"]
            for position, p in enumerate(done.params)
            if position in self.positions and "exp_avg" in done.state[p]
        ]
        mean = ExactMean(done.transport, COMM_DTYPES[self.options.dtype])
        for bucket in plan_buckets([m.numel() for m in momenta], done.bucket_size):
            slices = [piece_of(momenta[piece.tensor_index], piece) for piece in bucket]
            sizes = [piece.length for piece in bucket]
            averaged = mean.finish(mean.start(Bucket(torch.cat(slices), sizes, [])))
            for target, value in zip(slices, averaged.split(sizes), strict=True):
                target.copy_(value)


class ReplicaCheck:
    """Every ``interval`` steps, raise the same error on every rank if the voters' parameters differ
    (option ``consistency_check``; :func:`ds_lioncub.consistency.replica_check.check_replicas`). Runs only where
    the voters hold replicas."""

    def __init__(self, options: ConsistencyCheckConfig) -> None:
        self.options = options

    def __call__(self, done: StepDone) -> None:
        interval = self.options.interval
        if not interval or done.step % interval != 0 or not done.params_are_replicas:
            return
        if done.names:
            labels = [repr(name) for name in done.names]
        else:
            labels = [f"parameter #{i} of shape {tuple(p.shape)}" for i, p in enumerate(done.params)]
        check_replicas(done.transport, done.params, labels, done.step, agreement=done.agreement)


__all__ = ["MomentumSync", "PostStepHook", "ReplicaCheck", "StepDone"]
