"""LionCub's set-up before its first step: one set-up on every rank, ``compression="auto"`` resolved, logged.

Called by :class:`~ds_lioncub.optimizer.LionCub` at construction (and, for the log line, when the
DeepSpeed wiring binds it to the engine's group). The collectives here are set-up traffic: each runs
inside ``transport.uncounted()``, so ``comm_stats()`` counts the steps' traffic only.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_lioncub._logging import get_logger
from ds_lioncub._version import __version__
from ds_lioncub.aggregation import Aggregator
from ds_lioncub.comm.transport import Transport
from ds_lioncub.config import LionCubConfig
from ds_lioncub.consistency.fingerprint import agreed_text, check_same_on_every_rank
from ds_lioncub.planner.auto import (
    AUTO_NODE_SIZE_LABEL,
    AutoResolution,
    auto_node_size,
    log_auto_resolution,
    resolve_auto,
)
from ds_lioncub.planner.devices import device_of


def check_same_set_up(
    transport: Transport, options: LionCubConfig, param_groups: list[dict[str, Any]], layout: list[str]
) -> None:
    """Raise the same error on every rank if the ranks were built with different options or models
    (the set-up fingerprint, :func:`ds_lioncub.consistency.fingerprint.check_same_on_every_rank`)."""
    groups = [
        (len(group["params"]), group["lr"], tuple(group["betas"]), group["weight_decay"]) for group in param_groups
    ]
    components = [
        ("ds_lioncub version", __version__),
        ("world size", str(transport.world_size)),
        ("transport", transport.name),
        *((f"option {name}", repr(value)) for name, value in options.model_dump().items()),
        ("param groups (size, lr, betas, weight_decay)", repr(groups)),
    ]
    with transport.uncounted():  # the check's all-gather is set-up traffic
        check_same_on_every_rank(transport, components, layout)


def resolve_auto_at_construction(
    options: LionCubConfig, transport: Transport, params: list[torch.Tensor]
) -> AutoResolution:
    """The planner's choice for ``compression="auto"`` at ZeRO stage 0 (:mod:`ds_lioncub.planner.auto`),
    said on rank 0.

    Nodes of G ranks: G from ``hybrid.node_size`` or the launcher's variables, else one rank per node.
    """
    # Each rank reads G from its own environment; they must agree before each resolves alone.
    with transport.uncounted():
        node_size = int(agreed_text(transport, AUTO_NODE_SIZE_LABEL, lambda: str(auto_node_size(options, os.environ))))
    # The parameters' device is where the step's local work runs: it picks the planner's cost table.
    device = device_of(params[0].device.type) if params else "cpu"
    num_params = sum(p.numel() for p in params if p.requires_grad)
    resolution = resolve_auto(options, num_params, transport.world_size, node_size, device=device)
    log_auto_resolution(resolution, transport.rank)
    return resolution


def log_setting(
    transport: Transport,
    options: LionCubConfig,
    aggregator: Aggregator | None,
    logged: tuple[int, str] | None,
) -> tuple[int, str] | None:
    """Log the options as the step will run them, on rank 0, unless ``logged`` already said this (world,
    aggregation); returns what has now been logged."""
    aggregation = type(aggregator).__name__ if aggregator is not None else "none (local gradients)"
    setting = (transport.world_size, aggregation)
    if transport.rank != 0 or setting == logged:
        return logged
    get_logger().info(
        f"LionCub: {transport.world_size} rank(s) over {transport.name}, aggregation {aggregation}; {options.summary()}"
    )
    return setting


__all__ = ["check_same_set_up", "log_setting", "resolve_auto_at_construction"]
