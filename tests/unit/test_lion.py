"""Lion's three equations against a per-element float64 evaluation of the formulas."""

from __future__ import annotations

import torch

from ds_lioncub.lion import apply_update, lion_direction, update_momentum


def tensors(seed: int, n: int = 257) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator), torch.randn(n, generator=generator)


def test_direction_is_beta1_momentum_plus_one_minus_beta1_gradient() -> None:
    exp_avg, grad = tensors(1)
    beta1 = 0.9
    expected = [beta1 * float(m) + (1 - beta1) * float(g) for m, g in zip(exp_avg, grad, strict=True)]
    out = torch.empty(exp_avg.shape)
    result = lion_direction(exp_avg, grad, beta1, out=out)
    assert result is out and result.dtype == torch.float32
    assert torch.allclose(result.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.equal(lion_direction(exp_avg, grad, beta1), result)


def test_direction_of_bf16_state_is_fp32() -> None:
    exp_avg, grad = tensors(2)
    result = lion_direction(exp_avg.bfloat16(), grad.bfloat16(), 0.5)
    assert result.dtype == torch.float32
    expected = 0.5 * exp_avg.bfloat16().double() + 0.5 * grad.bfloat16().double()
    assert torch.allclose(result.double(), expected, rtol=1e-6, atol=1e-7)


def test_momentum_is_an_exponential_moving_average_of_the_gradient() -> None:
    exp_avg, grad = tensors(3)
    beta2 = 0.99
    expected = [beta2 * float(m) + (1 - beta2) * float(g) for m, g in zip(exp_avg, grad, strict=True)]
    update_momentum(exp_avg, grad, beta2)
    assert torch.allclose(exp_avg.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def test_update_decays_the_parameter_then_steps_against_the_direction() -> None:
    param, _ = tensors(4)
    direction = torch.sign(tensors(5)[0])
    lr, weight_decay = 0.01, 0.1
    expected = [float(x) * (1 - lr * weight_decay) - lr * float(d) for x, d in zip(param, direction, strict=True)]
    apply_update(param, direction, lr, weight_decay)
    assert torch.allclose(param.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def test_no_weight_decay_leaves_the_parameter_undecayed_bit_for_bit() -> None:
    param, _ = tensors(6)
    direction = torch.sign(tensors(7)[0])
    expected = param - 0.01 * direction
    apply_update(param, direction, 0.01, 0.0)
    assert torch.equal(param, expected)
