"""The per-rank optimizer state a checkpoint keeps beside DeepSpeed's files: each rank's own momentum, and
its aggregation's state (error feedback's residuals or estimates).

Every LionCub rank keeps its own ``exp_avg`` (the ranks vote on directions, not momenta), so a
checkpoint must hold every rank's, by flat parameter position (group order, then parameter order);
``integration/checkpoint.py`` writes and reads them through ``LionCub.engine_side.local_momentum_state`` and
``load_local_momentum``, which call these. With error feedback each rank's aggregation also
keeps per-bucket state (:class:`~ds_lioncub.aggregation.AggregationState`), saved in the same file
(``aggregation_state`` / ``load_aggregation_state``, through :func:`saved_aggregation_state` and
:func:`restore_aggregation_state`).

The gradient noise scale's moving averages (:mod:`ds_lioncub.step.noise_scale`), the same on every rank, go into
``LionCub.state_dict()`` under :data:`NOISE_SCALE_KEY` (what torch and DeepSpeed's stage 0 save), and into the same
per-rank file (DeepSpeed's ZeRO keeps only the optimizer's per-parameter state), so that a resumed run reports
the noise scale an uninterrupted one does instead of starting its average over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds_lioncub.aggregation import Aggregator
from ds_lioncub.consistency.fingerprint import describe_parameters
from ds_lioncub.errors import LionCubSetupError
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


def parameter_layout(
    param_groups: list[dict[str, Any]], names: list[str] | None, module: nn.Module | None
) -> list[str]:
    """One line per parameter in flat position order: name (or ``#position``), shape, dtype: what the ranks compare
    at set-up and what a checkpoint's momenta must match on load. ``names``: by flat position, None to take them
    from the parameters or ``module``."""
    if names is None:
        names = names_by_position(param_groups, module)
    params = [param for group in param_groups for param in group["params"]]
    return describe_parameters(list(names) if names is not None else [None] * len(params), params)


__all__ = [
    "NOISE_SCALE_KEY",
    "parameter_layout",
    "load_local_momenta",
    "local_momenta",
    "restore_aggregation_state",
    "saved_aggregation_state",
]
