"""The per-rank optimizer state a checkpoint keeps beside DeepSpeed's files: each rank's own momentum.

Every LionCub rank keeps its own ``exp_avg`` (the ranks vote on directions, not momenta), so a
checkpoint must hold every rank's, by flat parameter position (group order, then parameter order);
``integration/checkpoint.py`` writes and reads them through ``LionCub.local_momentum_state`` and
``LionCub.load_local_momentum``, which call these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_lioncub.errors import LionCubSetupError


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


__all__ = ["load_local_momenta", "local_momenta"]
