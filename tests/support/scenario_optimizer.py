"""The scenarios' model (tests/support/scenarios.py) with a LionCub over it, built one way everywhere.

The gloo and MPI workers and the in-process tests train the same parameters with the same
hyperparameters; only the options that are the point of each test differ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ds_lioncub import LionCub
from tests.support import scenarios as sc


def fresh_params(device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The scenarios' initial parameters, as new leaf tensors on ``device`` that require grad."""
    return {name: value.clone().to(device).requires_grad_(True) for name, value in sc.init_params().items()}


def scenario_settings(**options: Any) -> dict[str, Any]:
    """The scenarios' lr, betas, weight decay and bucket size, with ``options`` added (or replacing them)."""
    settings: dict[str, Any] = {
        "lr": sc.TRAIN_LR,
        "betas": sc.TRAIN_BETAS,
        "weight_decay": sc.TRAIN_WEIGHT_DECAY,
        "bucket_size": sc.BUCKET_SIZE,
    }
    return settings | options


def scenario_lioncub(params: dict[str, Tensor], **options: Any) -> LionCub:
    """LionCub over ``params`` with :func:`scenario_settings` and ``options``."""
    return LionCub(list(params.items()), **scenario_settings(**options))


def step_with_nan_on_last_rank(rank: int, world_size: int, **options: Any) -> tuple[dict[str, object], LionCub]:
    """One 1-bit step where the last rank's gradient holds a NaN: what it raised on this rank (``"nan-error"``,
    ``None`` if nothing) and whether the parameters were left unchanged (``"nan-unchanged"``)."""
    params = fresh_params()
    optimizer = LionCub(list(params.items()), compression="1bit", **options)
    sc.loss_of(params, rank, 1).backward()
    if rank == world_size - 1:
        params["b1"].grad[3] = float("nan")
    results: dict[str, object] = {}
    try:
        optimizer.step()
        results["nan-error"] = None
    except FloatingPointError as error:
        results["nan-error"] = str(error)
    results["nan-unchanged"] = all(torch.equal(params[n], v) for n, v in sc.init_params().items())
    return results, optimizer
