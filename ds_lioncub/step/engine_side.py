"""What DeepSpeed's wiring (:mod:`ds_lioncub.integration`) asks of a LionCub beside ``torch.optim``'s surface:
:attr:`ds_lioncub.LionCub.engine_side`.

A user trains with ``step()``, ``state_dict()`` and the telemetry; the engine also steps in parts (ZeRO), creates
state on zeros (the mixed-precision wrapper), takes option ``clip``'s sketch before a step it cuts in parts, and
saves each rank's own momentum beside its checkpoint. Those calls live here, one object over the optimizer's
state and its rank's step, so that :class:`~ds_lioncub.LionCub` stays the front a user reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ds_lioncub.comm.transport import CommStats
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.local_state import (
    load_local_momenta,
    local_momenta,
    parameter_layout,
    restore_aggregation_state,
    saved_aggregation_state,
)
from ds_lioncub.step.parts import StepCalls
from ds_lioncub.step.rank_step import RankStep


class Front(Protocol):
    """The optimizer an :class:`EngineSide` serves (:class:`ds_lioncub.LionCub`)."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]
    param_names: list[str] | None
    module: nn.Module | None
    rank_step: RankStep
    calls: StepCalls

    def comm_stats(self) -> CommStats: ...


@dataclass(frozen=True)
class EngineSide:
    """The calls of DeepSpeed's wiring on one LionCub (every method's name was LionCub's own until 0.2.0); two are
    equal when they serve the same optimizer."""

    _optimizer: Front

    def _flat_params(self) -> list[torch.Tensor]:
        return [param for group in self._optimizer.param_groups for param in group["params"]]

    # ------------------------------------------------------------------ what a step() call is (step/parts.py)

    def initialising_states(self) -> AbstractContextManager[None]:
        """Within this block ``step()`` only creates optimizer state and changes nothing: DeepSpeed's fp16/bf16
        wrapper steps once on zero gradients to create it, where a Lion Cub step would move every parameter by lr."""
        return self._optimizer.calls.initialising_states()

    def optimizer_step_in_parts(self) -> AbstractContextManager[None]:
        """Within this block every ``step()`` call is one part of a single optimizer step (DeepSpeed's ZeRO-3 steps
        one flat sub-group per call; :meth:`~ds_lioncub.step.parts.StepCalls.optimizer_step_in_parts`)."""
        return self._optimizer.calls.optimizer_step_in_parts(self._optimizer.param_groups)

    def bucket_keys_from(self, first_tensor: int) -> AbstractContextManager[None]:
        """Within this block the tensors of a ``step()`` call are numbered from ``first_tensor`` in the bucket keys
        of error feedback's state (ZeRO-1/2 steps each param group in its own call)."""
        return self._optimizer.calls.bucket_keys_from(first_tensor)

    # ------------------------------------------------------------------ option clip (step/clipping.py)

    @property
    def next_step(self) -> int:
        """The number of the step the next ``step()`` takes (1 for the first)."""
        groups = self._optimizer.param_groups
        return groups[0]["step"] + 1 if groups else 1

    @property
    def sketches_each_step(self) -> bool:
        """Whether every step sketches the gradients and sums the sketch over the ranks: for option ``clip``, the
        noise scale, or both (one sketch serves both)."""
        return self._optimizer.rank_step.clip.sketches_each_step

    @property
    def measures_noise_scale(self) -> bool:
        """Whether the steps measure the gradient noise scale: option ``telemetry.noise_scale``, a compressed mode, two
        voters or more."""
        return self._optimizer.rank_step.clip.measures_noise_scale

    def sketch_step(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float = 1.0, first_tensor: int = 0
    ) -> float | None:
        """The step's sketch, for a caller that steps in parts (the ZeRO hybrids), before the first part: what
        :meth:`clip_coefficient` does, and the noise scale's update when it is measured; returns option ``clip``'s
        factor, or None when LionCub does not clip. Give the result to :meth:`clip_coefficient_given`.

        A collective over the agreement group, called by every rank when :attr:`sketches_each_step` is true. Its
        traffic counts toward the step that follows (:meth:`take_traffic_before_step`).
        """
        optimizer = self._optimizer
        return optimizer.rank_step.clip.sketch_step(tensors, step, optimizer.comm_stats, loss_scale, first_tensor)

    def clip_coefficient(
        self, tensors: Sequence[Sequence[torch.Tensor]], step: int, loss_scale: float = 1.0, first_tensor: int = 0
    ) -> float:
        """Option ``clip``'s factor for step ``step``: the sketch of this rank's gradients (``tensors[t]``: the pieces
        of flat tensor ``first_tensor + t``), summed over the ranks by one all-reduce (one per level under the ZeRO
        hybrid), gives the estimated norm of the voters' mean gradient (divided by ``loss_scale``) and
        ``min(1, max_norm / (norm + 1e-6))``.

        A collective: every rank of the agreement group (the voters; under the ZeRO hybrid the whole world, each
        rank with its shard) calls it once per step with the same layout, and all get the same factor
        (:mod:`ds_lioncub.step.clipping`). With the noise scale measured, the same all-reduce updates it.
        """
        if self._optimizer.rank_step.options.mean_clip is None:
            raise LionCubSetupError("LionCub: clip_coefficient() needs option clip, e.g. clip={'max_norm': 1.0}.")
        factor = self.sketch_step(tensors, step, loss_scale, first_tensor)
        assert factor is not None
        return factor

    def clip_coefficient_given(self, coefficient: float | None) -> AbstractContextManager[None]:
        """Within this block ``step()`` scales the gradients by ``coefficient`` instead of computing option ``clip``'s
        (None: LionCub does not clip), and takes the step's sketch as taken.

        For callers that step in parts (DeepSpeed's ZeRO under the hybrid steps one flat shard per call), which
        sketch once over every part with :meth:`sketch_step` (or :meth:`clip_coefficient`) before the first.
        """
        return self._optimizer.rank_step.clip.coefficient_given(coefficient)

    def take_traffic_before_step(self) -> CommStats:
        """What was sent for a step that never ran (option clip's all-reduce before a step DeepSpeed then skipped),
        for that step's record; it no longer counts toward the next step."""
        return self._optimizer.rank_step.clip.take_traffic_before_step()

    # ------------------------------------------------------------------ what a checkpoint keeps (step/local_state.py)

    def parameter_layout(self) -> list[str]:
        """One line per parameter in flat position order: name (or ``#position``), shape, dtype: what the ranks
        compare at set-up and what a checkpoint's momenta must match on load."""
        optimizer = self._optimizer
        return parameter_layout(optimizer.param_groups, optimizer.param_names, optimizer.module)

    def local_momentum_state(self) -> list[torch.Tensor | None]:
        """This rank's ``exp_avg`` by flat parameter position (None: no state yet), for checkpoints."""
        return local_momenta(self._flat_params(), self._optimizer.state)

    def load_local_momentum(self, momenta: list[torch.Tensor | None]) -> None:
        """Set ``exp_avg`` by flat parameter position (``None`` leaves a parameter's state as it is).

        Raises :class:`~ds_lioncub.errors.LionCubSetupError` when the count does not match.
        """
        load_local_momenta(self._flat_params(), self._optimizer.state, momenta)

    def aggregation_state(self) -> dict[str, Any] | None:
        """This rank's aggregation state for checkpoints (error feedback's residuals or estimates, per bucket,
        on the CPU); None where the aggregation keeps nothing across steps."""
        return saved_aggregation_state(self._optimizer.rank_step.aggregator)

    def load_aggregation_state(self, state: dict[str, Any] | None) -> str:
        """Take over :meth:`aggregation_state` of a checkpoint: "" when taken, else why the aggregation keeps
        its fresh state (error feedback then starts over from zeros)."""
        params = self._flat_params()
        device = params[0].device if params else torch.device("cpu")
        return restore_aggregation_state(self._optimizer.rank_step.aggregator, state, device)

    def noise_scale_state(self) -> dict[str, float | int]:
        """The gradient noise scale's moving averages, for a checkpoint (the same on every rank)."""
        return self._optimizer.rank_step.clip.noise_scale.state_dict()

    def load_noise_scale_state(self, state: dict[str, float | int]) -> None:
        """Take over :meth:`noise_scale_state` of a checkpoint."""
        self._optimizer.rank_step.clip.noise_scale.load_state_dict(state)


#: The names of :class:`EngineSide` that were LionCub's own (LionCub forwards them, with a DeprecationWarning, until
#: 0.3.0).
MOVED_TO_ENGINE_SIDE = (
    "initialising_states",
    "optimizer_step_in_parts",
    "bucket_keys_from",
    "next_step",
    "sketches_each_step",
    "measures_noise_scale",
    "sketch_step",
    "clip_coefficient",
    "clip_coefficient_given",
    "take_traffic_before_step",
    "parameter_layout",
    "local_momentum_state",
    "load_local_momentum",
    "aggregation_state",
    "load_aggregation_state",
    "noise_scale_state",
    "load_noise_scale_state",
)

__all__ = ["MOVED_TO_ENGINE_SIDE", "EngineSide", "Front"]
