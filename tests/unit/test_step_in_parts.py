"""LionCub.engine_side.optimizer_step_in_parts: several step() calls, each with some of the parameters, are one
optimizer step.

ZeRO-3 steps the optimizer once per sub-group with that sub-group's flat tensor as its only parameter. In a world
of one rank the 1-bit vote is the rank's own sign with exact zeros resolved by the tie rule of the step, so a
plain Lion loop with that rule (written here) is the reference: the parts of one step must share its tie value.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from ds_lioncub import LionCub
from ds_lioncub.errors import LionCubError
from tests.support.reference import tie_value

LR, WD, BETAS = 0.1, 0.01, (0.9, 0.99)


def _gradient(step: int, numel: int) -> Tensor:
    """Gradients with exact zeros (with zero momentum at step 1, c = 0 there: the tie decides)."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(7 * step + numel))
    g[::3] = 0.0
    return g


def _plain_lion(params: list[Tensor], steps: int) -> tuple[list[Tensor], list[Tensor]]:
    params = [p.clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    for step in range(1, steps + 1):
        for p, m in zip(params, momenta, strict=True):
            g = _gradient(step, p.numel())
            c = m * BETAS[0] + g * (1 - BETAS[0])
            d = torch.where(c > 0, 1.0, torch.where(c < 0, -1.0, float(tie_value(step, "alternate"))))
            p.mul_(1 - LR * WD).add_(d, alpha=-LR)
            m.mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])
    return params, momenta


def _stepped_in_parts(steps: int, skip: int | None = None) -> tuple[LionCub, list[Tensor]]:
    """Two tensors in one param group, stepped ZeRO-3's way: the group holds one of them per step() call."""
    tensors = [torch.nn.Parameter(torch.linspace(-1, 1, 7)), torch.nn.Parameter(torch.linspace(2, -2, 5))]
    opt = LionCub(tensors, lr=LR, betas=BETAS, weight_decay=WD, compression="1bit")
    for step in range(1, steps + 1):
        with opt.engine_side.optimizer_step_in_parts():
            if step == skip:
                continue  # a skipped step: no part runs
            for tensor in tensors:
                opt.param_groups[0]["params"] = [tensor]
                tensor.grad = _gradient(step, tensor.numel())
                opt.step()
            opt.param_groups[0]["params"] = []
    opt.param_groups[0]["params"] = tensors
    return opt, tensors


def test_the_parts_of_a_step_share_its_tie_rule_and_the_count_advances_once() -> None:
    opt, tensors = _stepped_in_parts(3)
    params, momenta = _plain_lion([torch.linspace(-1, 1, 7), torch.linspace(2, -2, 5)], 3)
    assert opt.param_groups[0]["step"] == 3
    for tensor, expected, momentum in zip(tensors, params, momenta, strict=True):
        assert torch.equal(tensor.detach(), expected)
        assert torch.equal(opt.state[tensor]["exp_avg"], momentum)


def test_a_block_in_which_no_part_ran_leaves_the_count() -> None:
    opt, _ = _stepped_in_parts(3, skip=2)
    assert opt.param_groups[0]["step"] == 2


def test_blocks_do_not_nest_and_a_raising_part_leaves_the_count() -> None:
    opt = LionCub([torch.nn.Parameter(torch.zeros(3))], lr=LR, compression="1bit")
    with opt.engine_side.optimizer_step_in_parts(), pytest.raises(LionCubError, match="do not nest"):
        with opt.engine_side.optimizer_step_in_parts():
            pass
    with pytest.raises(RuntimeError, match="boom"), opt.engine_side.optimizer_step_in_parts():
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()
        raise RuntimeError("boom")
    assert opt.param_groups[0]["step"] == 0
