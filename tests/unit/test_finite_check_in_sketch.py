"""The non-finite check carried by the step's sketch (issue #44): where the sketch runs (option ``clip``, the noise
scale), its all-reduce carries each rank's "my gradient is not finite" as one more number, so a step agrees on the
sketch and the verdict in one collective instead of two; every rank still raises the same error before any state
changes, and the steps are bit for bit the plain loop's (tests/support/reference.py, tests/support/clip_reference.py).

The collectives are counted on the thread ranks' transports themselves (each call of ``all_reduce_sum`` and each raw
exchange), not by LionCub's telemetry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from ds_lioncub.errors import NonFiniteGradientError
from tests.support.clip_reference import clipped_grads_fn
from tests.support.reference import simulate_lioncub
from tests.support.thread_world import ThreadLionCub, ThreadTransport, on_every_rank

P = 3
SHAPES = ((40, 30), (30,))
LR = 1e-3
#: Attempts of a step on every rank; attempt NAN_ATTEMPT has a NaN on rank NAN_RANK and is refused.
ATTEMPTS = 4
NAN_ATTEMPT, NAN_RANK = 2, 1
MAX_NORM = 1.0
#: Option sets and what each step's all_reduce_sum calls are: (dtype, numel) per call.
CASES: dict[str, tuple[dict[str, Any], list[tuple[torch.dtype, int]]]] = {
    # The default: the noise scale's sketch (bins + the squared norm) and the verdict, one fp64 all-reduce.
    "noise scale": ({}, [(torch.float64, DEFAULT_SKETCH_BINS + 2)]),
    "clip and noise scale": ({"clip": {"max_norm": MAX_NORM}}, [(torch.float64, DEFAULT_SKETCH_BINS + 2)]),
    "clip alone": (
        {"clip": {"max_norm": MAX_NORM}, "telemetry": {"noise_scale": False}},
        [(torch.float64, DEFAULT_SKETCH_BINS + 1)],
    ),
    # No sketch: the check's own int32 all-reduce, as before.
    "no sketch": ({"telemetry": {"noise_scale": False}}, [(torch.int32, 1)]),
}


def init_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def gradient(rank: int, attempt: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * attempt + rank)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if (rank, attempt) == (NAN_RANK, NAN_ATTEMPT):
        grads[1][7] = float("nan")
    return grads


def train(transport: ThreadTransport, options: dict[str, Any]) -> dict[str, Any]:
    """ATTEMPTS steps of a 1-bit LionCub; per attempt: the all_reduce_sum calls, the raw exchanges, the error
    raised (None), and the parameters, momenta, step and noise scale after it."""
    calls: list[tuple[torch.dtype, int]] = []
    original = transport.all_reduce_sum

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        calls.append((tensor.dtype, tensor.numel()))
        return original(tensor)

    transport.all_reduce_sum = counted  # type: ignore[method-assign]
    params = [torch.nn.Parameter(t.clone()) for t in init_params()]
    optimizer = ThreadLionCub(transport, params, lr=LR, compression="1bit", **options)
    attempts = []
    for attempt in range(1, ATTEMPTS + 1):
        for param, grad in zip(params, gradient(transport.rank, attempt), strict=True):
            param.grad = grad
        calls.clear()
        raw_before = len(transport.raw_calls)
        error = None
        try:
            optimizer.step()
        except NonFiniteGradientError as caught:
            error = str(caught)
        attempts.append(
            {
                "calls": list(calls),
                "raw": transport.raw_calls[raw_before:],
                "error": error,
                "params": [p.detach().clone() for p in params],
                "momenta": [optimizer.state[p]["exp_avg"].clone() if p in optimizer.state else None for p in params],
                "step": optimizer.param_groups[0]["step"],
                "noise": optimizer.noise_scale,
            }
        )
    return {"attempts": attempts, "last_clip": optimizer.last_clip_coefficient}


def run(options: dict[str, Any]) -> list[dict[str, Any]]:
    return on_every_rank(P, lambda transport: train(transport, options))


def reference(options: dict[str, Any]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The plain loop over the steps applied: the refused attempt left out, its step number taken by the next."""
    applied = [attempt for attempt in range(1, ATTEMPTS + 1) if attempt != NAN_ATTEMPT]
    grads: Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]] = lambda rank, step, params: gradient(  # noqa: E731
        rank, applied[step - 1]
    )
    if "clip" in options:
        grads = clipped_grads_fn(grads, P, MAX_NORM, DEFAULT_SKETCH_BINS, [])
    return simulate_lioncub(init_params(), grads, P, len(applied), lr=LR, compression="1bit")


@pytest.mark.parametrize("case", CASES)
def test_each_step_agrees_in_the_calls_expected_and_raw_exchanges(case: str) -> None:
    """Where a sketch runs, a step's one all_reduce_sum is the sketch with the verdict (an fp64 sum: one all-to-all
    and one all-gather), and no int32 all-reduce is left; then the one bucket's vote (an all-to-all, an all-gather).
    The refused attempt issues the agreement only."""
    options, expected = CASES[case]
    sketch = ["all_to_all", "all_gather"] if expected[0][0] == torch.float64 else ["integer_all_reduce"]
    for rank, result in enumerate(run(options)):
        for attempt, record in enumerate(result["attempts"], 1):
            where = f"{case}: rank {rank}, attempt {attempt}"
            assert record["calls"] == expected, where
            vote = [] if attempt == NAN_ATTEMPT else ["all_to_all", "all_gather"]
            assert record["raw"] == sketch + vote, where


@pytest.mark.parametrize("case", CASES)
def test_a_nan_on_one_rank_stops_every_rank_before_any_change_and_the_steps_equal_the_plain_loop(case: str) -> None:
    options, _ = CASES[case]
    ranks = run(options)
    for rank, result in enumerate(ranks):
        error = result["attempts"][NAN_ATTEMPT - 1]["error"]
        assert error is not None and f"on 1 of {P} ranks at step {NAN_ATTEMPT}" in error, rank  # one verdict
        here = "parameter #1 of shape (30,)" if rank == NAN_RANK else "none"  # this rank's offending parameters
        assert f"(this rank's offending parameters: {here})" in error, error
        before, refused = result["attempts"][NAN_ATTEMPT - 2], result["attempts"][NAN_ATTEMPT - 1]
        assert refused["step"] == before["step"] == NAN_ATTEMPT - 1
        for got, was in zip(refused["params"] + refused["momenta"], before["params"] + before["momenta"], strict=True):
            assert torch.equal(got, was), rank
        assert refused["noise"] == before["noise"]  # the refused step is not measured
        assert all(record["error"] is None for n, record in enumerate(result["attempts"], 1) if n != NAN_ATTEMPT)
    params, momenta = reference(options)
    for rank, result in enumerate(ranks):
        last = result["attempts"][-1]
        assert last["step"] == ATTEMPTS - 1
        for index, (got, want) in enumerate(zip(last["params"], params, strict=True)):
            assert torch.equal(got, want), (case, rank, index)
        for index, (got, want) in enumerate(zip(last["momenta"], momenta[rank], strict=True)):
            assert torch.equal(got, want), (case, rank, index)
    if "clip" in options:
        assert all(result["last_clip"] < 1.0 for result in ranks), "no step clipped"
