"""Error feedback through LionCub itself (a world of one, in process): the telemetry's ratio against the
residual or estimate written out here with plain torch, and the checkpoint round trip of the aggregation
state (``aggregation_state`` / ``load_aggregation_state``) against the uninterrupted run, bit for bit."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from ds_lioncub import LionCub

L1_A2A = {"compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall", "bits": 2}
HYPER = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.0}


def gradient(step: int, numel: int = 3000) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(step))


def one_step(kind: str) -> tuple[LionCub, torch.Tensor]:
    param = torch.zeros(3000, requires_grad=True)
    optimizer = LionCub([param], **HYPER, **L1_A2A, error_feedback={"kind": kind})
    param.grad = gradient(1)
    optimizer.step()
    c = torch.zeros(3000).mul_(0.9).add_(param.grad, alpha=1 - 0.9)  # Lion's c with a zero momentum
    return optimizer, c


def test_the_residual_ratio_is_the_residual_over_c() -> None:
    optimizer, c = one_step("residual")
    scale = 1 / (2.0 * c.abs().mean())  # L / (tau * mu), L = 1 at 2 bits
    q = torch.round(c * scale).clamp(-1, 1)
    # e starts at 0: beta * 0 + (1 - beta) * (h - dequant(q)), h clipped to the levels' range [-1/s, 1/s] first
    # (feed_back "rounding", the default)
    residual = (c.clamp(-1 / scale, 1 / scale) - q / scale) * (1 - 0.9)
    record = optimizer.last_step_telemetry
    assert record is not None and record.feedback_kind == "residual"
    expected = float(residual.double().norm() / c.double().norm())
    assert record.feedback_ratio == pytest.approx(expected, rel=1e-6)
    assert ("LionCub/ef_residual_ratio", record.feedback_ratio) in record.monitor_events()


def test_the_ef21_ratio_is_what_the_estimate_still_misses() -> None:
    optimizer, c = one_step("ef21")
    step = 2.0 * c.abs().mean() / 1  # u = tau * sigma / L; one rank: sigma is its own mean |c - 0|
    d = torch.round(c / step).clamp(-1, 1)
    missed = c - d * step  # c - G_i after G_i += u * d
    record = optimizer.last_step_telemetry
    assert record is not None and record.feedback_kind == "ef21"
    assert record.feedback_ratio == pytest.approx(float(missed.double().norm() / c.double().norm()), rel=1e-6)
    assert ("LionCub/ef21_estimate_gap", record.feedback_ratio) in record.monitor_events()


def test_no_feedback_no_ratio() -> None:
    param = torch.zeros(3000, requires_grad=True)
    optimizer = LionCub([param], **HYPER, **L1_A2A)
    param.grad = gradient(1)
    optimizer.step()
    record = optimizer.last_step_telemetry
    assert record is not None and record.feedback_ratio is None
    assert not any("ef" in name for name, _ in record.monitor_events())


def train(optimizer: LionCub, param: torch.Tensor, steps: range) -> None:
    for step in steps:
        param.grad = gradient(step) + 0.3 * param.detach()
        optimizer.step()


@pytest.mark.parametrize(
    "feedback", [{"kind": "residual", "reset_interval": 4}, {"kind": "residual", "storage": "bf16"}, {"kind": "ef21"}]
)
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(feedback: dict[str, Any]) -> None:
    def build() -> tuple[LionCub, torch.Tensor]:
        param = torch.linspace(-1, 1, 3000).requires_grad_(True)
        return LionCub([param], **HYPER, **L1_A2A, bucket_size=1024, error_feedback=feedback), param

    uninterrupted, expected = build()
    train(uninterrupted, expected, range(1, 9))
    first, param = build()
    train(first, param, range(1, 5))
    saved = io.BytesIO()
    torch.save({"optimizer": first.state_dict(), "aggregation": first.engine_side.aggregation_state()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed, resumed_param = build()
    with torch.no_grad():
        resumed_param.copy_(param)
    resumed.load_state_dict(checkpoint["optimizer"])
    assert resumed.engine_side.load_aggregation_state(checkpoint["aggregation"]) == ""
    train(resumed, resumed_param, range(5, 9))
    assert torch.equal(resumed_param, expected)
    # Without the aggregation state the resumed run differs: the state is what makes the resume exact.
    fresh, fresh_param = build()
    with torch.no_grad():
        fresh_param.copy_(param)
    fresh.load_state_dict(checkpoint["optimizer"])
    train(fresh, fresh_param, range(5, 9))
    assert not torch.equal(fresh_param, expected)


def test_a_state_saved_under_other_knobs_is_not_taken() -> None:
    param = torch.zeros(3000, requires_grad=True)
    saver = LionCub([param], **HYPER, **L1_A2A, error_feedback={"kind": "residual", "beta": 0.9})
    train(saver, param, range(1, 3))
    other = LionCub([torch.zeros(3000, requires_grad=True)], **HYPER, **L1_A2A, error_feedback={"kind": "residual"})
    saved = saver.engine_side.aggregation_state()
    assert other.engine_side.load_aggregation_state(saved) == ""  # the same knobs (beta 0.9 is the default)
    changed = LionCub(
        [torch.zeros(3000, requires_grad=True)], **HYPER, **L1_A2A, error_feedback={"kind": "residual", "beta": 0.8}
    )
    why = changed.engine_side.load_aggregation_state(saver.engine_side.aggregation_state())
    assert "cannot load" in why and "'beta': 0.8" in why
    assert changed.engine_side.aggregation_state() is None  # it starts over from zeros
    assert changed.engine_side.load_aggregation_state(None).startswith("the checkpoint holds no aggregation state")


def two_groups_trained(kind: str, per_group_calls: bool, numbered: bool = True) -> tuple[list[torch.Tensor], LionCub]:
    """Two param groups (3000 and 1000 elements) for 4 steps: in one step() call each, or ZeRO-1/2's way, one
    call per group with only that group in ``param_groups`` (numbered by ``bucket_keys_from`` when asked)."""
    params = [torch.zeros(3000, requires_grad=True), torch.zeros(1000, requires_grad=True)]
    optimizer = LionCub(
        [{"params": [params[0]]}, {"params": [params[1]]}], **HYPER, **L1_A2A, error_feedback={"kind": kind}
    )
    groups = optimizer.param_groups
    for step in range(1, 5):
        params[0].grad, params[1].grad = gradient(step), gradient(100 + step, 1000)
        if not per_group_calls:
            optimizer.step()
            continue
        for index, group in enumerate(groups):
            optimizer.param_groups = [group]
            try:
                if numbered:
                    with optimizer.engine_side.bucket_keys_from(index):
                        optimizer.step()
                else:
                    optimizer.step()
            finally:
                optimizer.param_groups = groups
    return [p.detach().clone() for p in params], optimizer


@pytest.mark.parametrize("kind", ["residual", "ef21"])
def test_one_call_per_param_group_numbered_by_bucket_keys_from_keeps_each_groups_state(kind: str) -> None:
    """Stepped one group per call (as ZeRO-1/2 does), the bits are those of one call for both groups (every
    scale is per tensor), and each group's state has its own key; without the numbering the two groups'
    states would share key (0, 0) and overwrite each other, which changes the result."""
    together, _ = two_groups_trained(kind, per_group_calls=False)
    apart, optimizer = two_groups_trained(kind, per_group_calls=True)
    assert all(torch.equal(a, b) for a, b in zip(apart, together, strict=True))
    state = optimizer.engine_side.aggregation_state()
    assert state is not None
    name = "residual" if kind == "residual" else "estimate"
    assert {key: tensors[name].numel() for key, tensors in state["buckets"].items()} == {(0, 0): 3000, (1, 0): 1000}
    colliding, _ = two_groups_trained(kind, per_group_calls=True, numbered=False)
    assert not all(torch.equal(a, b) for a, b in zip(colliding, together, strict=True))
