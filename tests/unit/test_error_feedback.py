"""Error feedback on the k-bit L1 path (docs/design.md, section 4.8) in the virtual world at 16 and 33 workers.

Each form against the plain loop of tests/support/error_feedback_reference.py (torch's elementwise
operations, no ds_lioncub code): the parameters, every worker's momentum and every worker's EF state
(residual, or G_i and the shared G, which the library keeps one chunk per owner) bit for bit after 5
steps. Then the refusals, with their messages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub import LionCubConfigError, parse_config
from ds_lioncub.aggregation.error_feedback import ResidualState
from ds_lioncub.simulate import VirtualLionCub
from tests.support import scenarios as sc
from tests.support.error_feedback_reference import EfWorld, plan_pieces, simulate_ef

STEPS = 5
HYPER = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1, "bucket_size": 1024}

CASES: dict[str, dict[str, Any]] = {
    "residual-2bit-a2a": {"bits": 2, "kbit_algorithm": "alltoall", "error_feedback": {"kind": "residual"}},
    "residual-4bit-a2a-bf16-reset": {
        "bits": 4,
        "kbit_algorithm": "alltoall",
        "error_feedback": {"kind": "residual", "beta": 0.8, "reset_interval": 2, "storage": "bf16", "feed_back": "all"},
    },
    "residual-2bit-a2a-all": {
        "bits": 2,
        "kbit_algorithm": "alltoall",
        "error_feedback": {"kind": "residual", "feed_back": "all"},
    },
    "residual-4bit-a2a-rounding-bf16": {
        "bits": 4,
        "kbit_algorithm": "alltoall",
        "error_feedback": {"kind": "residual", "feed_back": "rounding", "storage": "bf16", "beta": 0.5},
    },
    "residual-2bit-a2a-mean": {
        "bits": 2,
        "kbit_algorithm": "alltoall",
        "aggregation": "mean",
        "error_feedback": {"kind": "residual", "beta": 0.95},
    },
    "residual-8bit-allreduce": {
        "bits": 8,
        "kbit_algorithm": "allreduce",
        "error_feedback": {"kind": "residual", "feed_back": "all"},
    },
    "ef21-2bit": {"bits": 2, "kbit_algorithm": "alltoall", "error_feedback": {"kind": "ef21"}},
    "ef21-4bit-clip3": {"bits": 4, "kbit_algorithm": "alltoall", "l1_clip": 3.0, "error_feedback": {"kind": "ef21"}},
}


def worker_grads(worker: int, step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """A gradient that depends on the parameters (so a wrong update changes every later step) and on the worker."""
    gen = torch.Generator().manual_seed(1000 * step + worker)
    return [0.5 * p.detach() + torch.randn(p.shape, generator=gen) * (1 + worker % 3) for p in params]


def virtual_world(workers: int, options: dict[str, Any]) -> VirtualLionCub:
    params = [value.clone().requires_grad_(True) for value in sc.init_params().values()]
    optimizer = VirtualLionCub(params, workers=workers, compression="kbit", quantizer="l1", **HYPER, **options)
    for step in range(1, STEPS + 1):
        optimizer.step([worker_grads(i, step, params) for i in range(workers)])
    return optimizer


def assert_state_matches(optimizer: VirtualLionCub, expected: EfWorld, kind: str, workers: int) -> None:
    keys = [(bucket[0][0], bucket[0][1]) for bucket in plan_pieces([p.numel() for p in expected.params], 1024)]
    for i in range(workers):
        state = optimizer.worker_aggregation_state(i)
        assert state is not None and sorted(state.buckets) == sorted(keys)
        for key in keys:
            if kind == "residual":
                assert torch.equal(state.buckets[key]["residual"], expected.residual[key][i]), (i, key)
                assert isinstance(state, ResidualState) and state.uses[key] == STEPS
            else:
                assert torch.equal(state.buckets[key]["estimate"], expected.estimate[key][i]), (i, key)
    if kind == "ef21":  # the shared G: one chunk per owner, in rank order, padding beyond the bucket
        for key in keys:
            chunks = [optimizer.worker_aggregation_state(i).buckets[key]["shared"] for i in range(workers)]  # type: ignore[union-attr]
            whole = torch.cat(chunks)
            numel = expected.shared[key].numel()
            assert torch.equal(whole[:numel], expected.shared[key]), key
            assert not torch.any(whole[numel:])


# Every case at 16 workers; the two forms at 2 bits also at 33 (an odd world: padded chunks of EF21's G).
WORLDS = [(case, 16) for case in sorted(CASES)] + [("residual-2bit-a2a", 33), ("ef21-2bit", 33)]


@pytest.mark.parametrize(("case", "workers"), WORLDS, ids=[f"{case}-{n}" for case, n in WORLDS])
def test_each_form_equals_the_plain_loop_bit_for_bit(case: str, workers: int) -> None:
    options = CASES[case]
    optimizer = virtual_world(workers, options)
    expected = simulate_ef(list(sc.init_params().values()), worker_grads, workers, STEPS, {**HYPER, **options})
    params = [group_param for group in optimizer.param_groups for group_param in group["params"]]
    init = list(sc.init_params().values())
    for got, want, start in zip(params, expected.params, init, strict=True):
        assert not torch.equal(got, start)
        assert torch.equal(got, want)
    for i in range(workers):
        for got, want in zip(optimizer.worker_momentum(i), expected.momenta[i], strict=True):
            assert torch.equal(got, want)
    assert_state_matches(optimizer, expected, options["error_feedback"]["kind"], workers)


def test_feedback_changes_the_trajectory() -> None:
    """The reference itself is not the no-feedback path: with EF the parameters differ from without it."""
    with_ef = virtual_world(16, CASES["ef21-2bit"])
    without = VirtualLionCub(
        [v.clone().requires_grad_(True) for v in sc.init_params().values()],
        workers=16,
        compression="kbit",
        quantizer="l1",
        bits=2,
        kbit_algorithm="alltoall",
        **HYPER,
    )
    params = [p for g in without.param_groups for p in g["params"]]
    for step in range(1, STEPS + 1):
        without.step([worker_grads(i, step, params) for i in range(16)])
    got = [p for g in with_ef.param_groups for p in g["params"]]
    assert any(not torch.equal(a, b) for a, b in zip(got, params, strict=True))


def test_feeding_back_only_the_rounding_changes_the_trajectory_and_bounds_the_residual() -> None:
    """The reference's "rounding" is not its "all": the clipped part of h changes the parameters, and without
    it the residual stays small (within half a level step), below the largest residual that keeps it."""
    rounding = simulate_ef(
        list(sc.init_params().values()), worker_grads, 16, STEPS, {**HYPER, **CASES["residual-2bit-a2a"]}
    )
    everything = simulate_ef(
        list(sc.init_params().values()), worker_grads, 16, STEPS, {**HYPER, **CASES["residual-2bit-a2a-all"]}
    )
    assert any(not torch.equal(a, b) for a, b in zip(rounding.params, everything.params, strict=True))
    largest = {
        name: max(float(e.abs().max()) for es in world.residual.values() for e in es)
        for name, world in (("rounding", rounding), ("all", everything))
    }
    assert largest["rounding"] < largest["all"], largest


BASE = {"compression": "kbit", "quantizer": "l1", "kbit_algorithm": "alltoall"}


def test_residual_knobs_with_ef21_are_refused() -> None:
    with pytest.raises(LionCubConfigError) as raised:
        parse_config({**BASE, "error_feedback": {"kind": "ef21", "beta": 0.8, "storage": "bf16"}})
    assert str(raised.value) == (
        "LionCub: invalid options: error_feedback={'kind': 'ef21', 'beta': 0.8, 'storage': 'bf16'}: beta, storage "
        "only apply to kind 'residual' (ef21 keeps an estimate, not a residual); drop them or set kind='residual'."
    )


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"kind": "lossless"}, "error_feedback.kind='lossless'"),
        ({}, "error_feedback.kind is required"),
        ({"kind": "residual", "beta": 1.0}, "error_feedback.beta=1.0"),
        ({"kind": "residual", "storage": "fp16"}, "error_feedback.storage='fp16'"),
        ({"kind": "residual", "reset_interval": -1}, "error_feedback.reset_interval=-1"),
        ({"kind": "residual", "feed_back": "clipping"}, "error_feedback.feed_back='clipping'"),
        ({"kind": "ef21", "feed_back": "rounding"}, "feed_back only apply to kind 'residual'"),
    ],
)
def test_bad_error_feedback_blocks_are_refused_naming_the_field(block: dict[str, Any], fragment: str) -> None:
    with pytest.raises(LionCubConfigError, match="LionCub: invalid options: ") as raised:
        parse_config({**BASE, "error_feedback": block})
    assert fragment in str(raised.value)


def test_the_virtual_world_refuses_ef_where_lioncub_does() -> None:
    params = [torch.zeros(8)]
    with pytest.raises(LionCubConfigError, match="error_feedback only applies to compression='kbit'"):
        VirtualLionCub(params, workers=16, compression="1bit", error_feedback={"kind": "residual"})
    with pytest.raises(LionCubConfigError, match="needs kbit_algorithm='alltoall'"):
        VirtualLionCub(params, workers=4, compression="kbit", quantizer="l1", error_feedback={"kind": "ef21"})
