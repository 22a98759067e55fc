"""Error feedback's state on one rank of a ZeRO hybrid job against the plain-loop simulation's (the ZeRO-1/2 and
ZeRO-3 hybrid tests share it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.support.error_feedback_reference import EfState


def assert_rank_feedback_matches(
    aggregation: dict[str, Any] | None, expected: EfState, node: int, nodes: int, kind: str, what: str
) -> None:
    """Rank (k, j)'s saved aggregation state (``LionCub.engine_side.aggregation_state()``) against the EF state of the
    simulated vote it takes part in, whose worker ``node`` it is: bucket keys, each residual (or EF21
    estimate G_i) bit for bit, not all zeros over the rank's buckets (else the comparison proves nothing; one
    bucket may be: a slice of one element and padding quantizes exactly), and EF21's shared G: the rank owns
    chunk ``node`` of it (the all-to-all over ``nodes``), zero past the bucket's end."""
    assert aggregation is not None, f"{what}: no error-feedback state"
    buckets: dict[Any, dict[str, Tensor]] = aggregation["buckets"]
    per_worker = expected.residual if kind == "residual" else expected.estimate
    assert sorted(buckets) == sorted(per_worker), what
    nonzero = False
    for key, tensors in buckets.items():
        got, want = tensors["residual" if kind == "residual" else "estimate"], per_worker[key][node]
        differ = int((got.float() != want.float()).sum()) if got.shape == want.shape else -1
        assert torch.equal(got, want), f"{what}, bucket {key}: {differ} elements differ (-1: shapes)"
        nonzero = nonzero or bool(got.any())
        if kind == "ef21":
            chunk, whole = tensors["shared"], expected.shared[key]
            whole = torch.cat([whole, torch.zeros(chunk.numel() * nodes - whole.numel())])
            assert torch.equal(chunk, whole[node * chunk.numel() : (node + 1) * chunk.numel()]), f"{what}, G {key}"
    assert nonzero, f"{what}: the state is all zeros"


def _assert_same_state(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert got.get("uses") == expected.get("uses"), f"{what}: the reset clock"
    assert sorted(got["buckets"]) == sorted(expected["buckets"]), what
    for key, tensors in expected["buckets"].items():
        for name, tensor in tensors.items():
            assert torch.equal(got["buckets"][key][name], tensor), f"{what}: {name} of bucket {key}"


def assert_feedback_resume_bitwise(
    resumed: list[dict[str, Any]], saved: list[dict[str, Any]], uninterrupted: list[dict[str, Any]], first_step: int
) -> None:
    """Per rank of a hybrid job resumed with error feedback: the state it loaded is the one it saved (the
    residual's reset clock too), and the parameters after every resumed step (from ``first_step``), the final
    momenta and the final state are those of the run that did not stop."""
    for rank, (record, at_save, reference) in enumerate(zip(resumed, saved, uninterrupted, strict=True)):
        assert record["loaded_aggregation"] is not None and at_save["aggregation"] is not None, f"rank {rank}"
        _assert_same_state(record["loaded_aggregation"], at_save["aggregation"], f"rank {rank}: loaded")
        for step, (got, expected) in enumerate(
            zip(record["params"], reference["params"][first_step - 1 :], strict=True), first_step
        ):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}, step {step}"
        for a, b in zip(record["momenta"], reference["momenta"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: momentum"
        _assert_same_state(record["aggregation"], reference["aggregation"], f"rank {rank}: final")
