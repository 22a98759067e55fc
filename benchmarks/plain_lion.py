"""Plain single-process Lion, the optimizer a torch DDP user pairs with a DDP communication hook.

DDP averages the gradients before ``step``; this optimizer then does what every rank would do alone:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

Written from the formula (Chen et al. 2023, Algorithm 2) for the DDP baselines of bench_train.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class PlainLion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0 or weight_decay < 0 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"need lr > 0, weight_decay >= 0, betas in [0, 1); got {lr}, {weight_decay}, {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                momentum = self.state[param].setdefault("exp_avg", torch.zeros_like(param))
                direction = (momentum * beta1).add_(grad, alpha=1 - beta1).sign_()
                param.mul_(1 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
                momentum.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
