"""Lion's three equations, the only place they are written.

For a parameter ``x`` with gradient ``g`` and momentum ``m``, one Lion step is::

    c = beta1 * m + (1 - beta1) * g           # the pre-sign update   (lion_direction)
    x = x * (1 - lr * wd) - lr * sign(c)      # decoupled weight decay (apply_update)
    m = beta2 * m + (1 - beta2) * g           # the momentum EMA       (update_momentum)

Lion Cub replaces ``sign(c)`` by an aggregate of the ranks' signs (``ds_lioncub.aggregation``); the
three equations themselves are the same for every mode.
"""

from __future__ import annotations

import torch


def lion_direction(
    exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Lion's pre-sign update ``c = beta1 * m + (1 - beta1) * g`` in fp32 (into ``out`` if given)."""
    if out is None:
        out = torch.empty(exp_avg.shape, dtype=torch.float32, device=exp_avg.device)
    return out.copy_(exp_avg).mul_(beta1).add_(grad, alpha=1 - beta1)


def apply_update(param: torch.Tensor, direction: torch.Tensor, lr: float, weight_decay: float) -> None:
    """``param = param * (1 - lr * wd) - lr * direction`` (decoupled weight decay), in place."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-lr)


def update_momentum(exp_avg: torch.Tensor, grad: torch.Tensor, beta2: float) -> None:
    """``m = beta2 * m + (1 - beta2) * g``, in place."""
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


__all__ = ["apply_update", "lion_direction", "update_momentum"]
