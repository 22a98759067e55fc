"""The per-rank optimizer state a checkpoint keeps beside DeepSpeed's files: each rank's own momentum, and
its aggregation's state (error feedback's residuals or estimates).

Every LionCub rank keeps its own ``exp_avg`` (the ranks vote on directions, not momenta), so a
checkpoint must hold every rank's, by flat parameter position (group order, then parameter order);
``integration/checkpoint.py`` writes and reads them through ``LionCub.local_momentum_state`` and
``LionCub.load_local_momentum``, which call these. With error feedback each rank's aggregation also
keeps per-bucket state (:class:`~ds_lioncub.aggregation.AggregationState`), saved in the same file
(``LionCub.aggregation_state`` / ``LionCub.load_aggregation_state``).

The gradient noise scale's moving averages (:mod:`ds_lioncub.step.noise_scale`), the same on every rank, go into
``LionCub.state_dict()`` under :data:`NOISE_SCALE_KEY` (what torch and DeepSpeed's stage 0 save), and into the same
per-rank file (DeepSpeed's ZeRO keeps only the optimizer's per-parameter state), so that a resumed run reports
the noise scale an uninterrupted one does instead of starting its average over.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.consistency.fingerprint import describe_parameters
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.step.noise_scale import NoiseScaleState
from ds_lioncub.step.param_selection import names_by_position

#: Where :meth:`CheckpointedState.state_dict` (and the per-rank checkpoint file) keeps the noise scale's averages.
NOISE_SCALE_KEY = "noise_scale"


def local_momenta(
    params: list[torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]]
) -> list[torch.Tensor | None]:
    """``exp_avg`` of each of ``params`` (None: no state yet)."""
    return [state[p].get("exp_avg") for p in params]


def load_local_momenta(
    params: list[torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]], momenta: list[torch.Tensor | None]
) -> None:
    """Set ``exp_avg`` of each of ``params`` from ``momenta`` (``None`` leaves a parameter's state as it is).

    Raises :class:`~ds_lioncub.errors.LionCubSetupError` when the counts differ.
    """
    if len(momenta) != len(params):
        raise LionCubSetupError(
            f"LionCub: the checkpoint's per-rank momentum files hold {len(momenta)} tensors but the optimizer "
            f"has {len(params)} parameters; the model or its parameter groups changed since saving."
        )
    for param, momentum in zip(params, momenta, strict=True):
        if momentum is None:
            continue
        param_state = state[param]
        if "exp_avg" not in param_state:
            param_state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        param_state["exp_avg"].copy_(momentum.view(param.shape))


def saved_aggregation_state(aggregator: Aggregator | None) -> dict[str, Any] | None:
    """The aggregation's state for a checkpoint file, its tensors copied to the CPU; None where it keeps
    nothing across steps (every aggregation without error feedback, or one that has not stepped yet)."""
    if aggregator is None or not aggregator.state.buckets:
        return None
    state = aggregator.state.state_dict()
    state["buckets"] = {
        key: {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}
        for key, tensors in state["buckets"].items()
    }
    return state


def restore_aggregation_state(aggregator: Aggregator | None, state: dict[str, Any] | None, device: torch.device) -> str:
    """Take over a saved aggregation state (its tensors moved to ``device``); returns "" when taken, else why
    not. Not taken, the aggregation keeps its fresh state: error feedback starts over from zeros, which is
    what a change of world size or of its knobs calls for (a residual kept under other knobs, or an estimate
    kept in another world's chunks, means something else)."""
    if state is None:
        return "the checkpoint holds no aggregation state (saved without error feedback)"
    if aggregator is None:
        return "this optimizer's aggregation keeps no state"
    moved = dict(state)
    moved["buckets"] = {
        key: {name: tensor.to(device) for name, tensor in tensors.items()} for key, tensors in state["buckets"].items()
    }
    try:
        aggregator.state.load_state_dict(moved)
    except ValueError as error:
        return str(error)
    return ""


class CheckpointedState:
    """What :class:`~ds_lioncub.optimizer.LionCub` hands a checkpoint beside DeepSpeed's files, and takes back
    (a base class of LionCub: the attributes below are LionCub's)."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]
    param_names: list[str] | None
    module: nn.Module | None
    _aggregator: Aggregator | None
    _noise_scale_state: NoiseScaleState

    def _flat_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict (this rank's momenta, the param groups), with the gradient noise scale's moving
        averages under :data:`NOISE_SCALE_KEY`."""
        state: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        state[NOISE_SCALE_KEY] = self._noise_scale_state.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's :meth:`load_state_dict`; the noise scale's averages too where saved (a state dict of
        0.2.0 or older, or of another optimizer, leaves them as they are)."""
        saved = state_dict.get(NOISE_SCALE_KEY)
        torch_state = {key: value for key, value in state_dict.items() if key != NOISE_SCALE_KEY}
        super().load_state_dict(torch_state)  # type: ignore[misc]
        if saved is not None:
            self._noise_scale_state.load_state_dict(saved)

    def noise_scale_state(self) -> dict[str, float | int]:
        """The gradient noise scale's moving averages, for a checkpoint (the same on every rank)."""
        return self._noise_scale_state.state_dict()

    def load_noise_scale_state(self, state: dict[str, float | int]) -> None:
        """Take over :meth:`noise_scale_state` of a checkpoint."""
        self._noise_scale_state.load_state_dict(state)

    def parameter_layout(self) -> list[str]:
        """One line per parameter in flat position order: name (or ``#position``), shape, dtype.

        What the ranks compare at set-up and what a checkpoint's momenta must match on load.
        """
        names = self.param_names if self.param_names is not None else names_by_position(self.param_groups, self.module)
        params = self._flat_params()
        return describe_parameters(list(names) if names is not None else [None] * len(params), params)

    def local_momentum_state(self) -> list[torch.Tensor | None]:
        """This rank's ``exp_avg`` by flat parameter position (None: no state yet), for checkpoints."""
        return local_momenta(self._flat_params(), self.state)

    def load_local_momentum(self, momenta: list[torch.Tensor | None]) -> None:
        """Set ``exp_avg`` by flat parameter position (``None`` leaves a parameter's state as it is).

        Raises :class:`~ds_lioncub.errors.LionCubSetupError` when the count does not match.
        """
        load_local_momenta(self._flat_params(), self.state, momenta)

    def aggregation_state(self) -> dict[str, Any] | None:
        """This rank's aggregation state for checkpoints (error feedback's residuals or estimates, per bucket,
        on the CPU); None where the aggregation keeps nothing across steps."""
        return saved_aggregation_state(self._aggregator)

    def load_aggregation_state(self, state: dict[str, Any] | None) -> str:
        """Take over :meth:`aggregation_state` of a checkpoint: "" when taken, else why the aggregation keeps
        its fresh state (error feedback then starts over from zeros)."""
        params = self._flat_params()
        device = params[0].device if params else torch.device("cpu")
        return restore_aggregation_state(self._aggregator, state, device)


__all__ = [
    "NOISE_SCALE_KEY",
    "load_local_momenta",
    "local_momenta",
    "restore_aggregation_state",
    "saved_aggregation_state",
]
