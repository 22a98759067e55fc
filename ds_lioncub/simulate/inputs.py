"""What :class:`~ds_lioncub.simulate.VirtualLionCub` takes: the options it refuses (a virtual world has no network
and no job of its own), and the checks of the gradients each step is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_lioncub.errors import LionCubConfigError

#: Options that describe a real network or job, which a virtual world has none of: refused when given.
NETWORK_OPTIONS = {
    "comm_backend_name": "the virtual world moves bytes in memory, not over a transport",
    "cuda_aware": "the virtual world moves bytes in memory, not over MPI",
    "overlap": "there is no backward pass to overlap: step() gets every worker's gradients at once",
    "hybrid": "a virtual worker is one voter, and under the ZeRO hybrid the voters are the nodes: pass workers=<nodes> "
    "and each node's batch (python -m ds_lioncub.simulate does so for a hybrid ds_config)",
    "consistency_check": "every virtual worker applies the update to the same single copy of the parameters",
    "network": "compression='auto' plans for a real network; plan with python -m ds_lioncub.planner and pass the mode",
}


def refuse_options(workers: int, options: dict[str, Any]) -> None:
    """Raise LionCub's error for a world size that is not a positive integer, or for options a virtual world does
    not take: :data:`NETWORK_OPTIONS`, ``compression="auto"`` and ``telemetry.vote_stats``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise LionCubConfigError(f"LionCub: workers must be a positive integer, got {workers!r}.")
    refused = sorted(set(options) & set(NETWORK_OPTIONS))
    if refused:
        reasons = "; ".join(f"{name}: {NETWORK_OPTIONS[name]}" for name in refused)
        raise LionCubConfigError(f"LionCub: VirtualLionCub does not take {refused} ({reasons}). Drop them.")
    if options.get("compression") == "auto":
        raise LionCubConfigError(
            "LionCub: VirtualLionCub takes a concrete mode, not compression='auto' (it plans for a real "
            "network); run python -m ds_lioncub.planner for your cluster and pass the mode it recommends."
        )
    telemetry = options.get("telemetry")
    if isinstance(telemetry, dict) and "vote_stats" in telemetry:
        raise LionCubConfigError(
            "LionCub: VirtualLionCub does not take telemetry.vote_stats; pass agreement_stats=True for the "
            "vote's agreement with exact Lion, and read worker_comm_stats(i) for bytes."
        )


def checked_gradients(
    worker_grads: Sequence[Sequence[torch.Tensor | None]], params: list[torch.Tensor], workers: int
) -> list[Sequence[torch.Tensor | None]]:
    """``worker_grads`` as a list, once it holds one gradient (or None) per parameter for each of ``workers``
    workers, each of its parameter's shape, dtype and device; LionCub's error otherwise."""
    if len(worker_grads) != workers:
        raise LionCubConfigError(
            f"LionCub: step() got gradients of {len(worker_grads)} workers for a world of {workers}; "
            f"pass worker_grads[i][j] for every worker i."
        )
    for i, grads in enumerate(worker_grads):
        if len(grads) != len(params):
            raise LionCubConfigError(
                f"LionCub: worker {i} has {len(grads)} gradients for {len(params)} parameters; pass one per "
                f"parameter, in the order of params (None for none)."
            )
        for j, (grad, param) in enumerate(zip(grads, params, strict=True)):
            if grad is not None and grad.shape != param.shape:
                raise LionCubConfigError(
                    f"LionCub: worker {i}'s gradient of parameter #{j} has shape {tuple(grad.shape)}, the "
                    f"parameter {tuple(param.shape)}; pass gradients in the order of params."
                )
            if grad is not None and (grad.dtype != param.dtype or grad.device != param.device):
                raise LionCubConfigError(
                    f"LionCub: worker {i}'s gradient of parameter #{j} is {grad.dtype} on {grad.device}, the "
                    f"parameter {param.dtype} on {param.device}; a rank's gradient has its parameter's dtype and "
                    f"device: convert it (grad.to(param))."
                )
    return list(worker_grads)


def or_zeros(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """A worker's gradient of ``param``; zeros for None, as on a real rank whose parameter got no gradient."""
    return torch.zeros_like(param) if grad is None else grad
