"""The compressed step's bucket schedule: pipelined buckets give the serial step's bits, on in-process worlds.

Each rank is a thread (tests/support/thread_world.py). The pipelined step runs on a transport that
moves data only when a collective is waited for, so a schedule that read a result early, reused a
buffer still being sent, or waited out of issue order would fail here; the serial step runs on the
plain thread transport. Both train the MLP of tests/support/scenarios.py for TRAIN_STEPS steps; their
parameters and momenta must be bit-identical on every rank, and match the brute-force simulation
(tests/support/reference.py) as the multi-process tests do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import scenarios as sc
from tests.support.scenario_optimizer import fresh_params, scenario_settings
from tests.support.thread_world import DeferredThreadTransport, ThreadLionCub, ThreadTransport, on_every_rank

MODES = {
    "1bit": {"compression": "1bit"},
    "1bit-positive": {"compression": "1bit", "tie_break": "positive"},
    "4bit-sign": {"compression": "kbit", "bits": 4},
    "4bit-sign-alltoall": {"compression": "kbit", "bits": 4, "kbit_algorithm": "alltoall"},
    "8bit-l1": {"compression": "kbit", "bits": 8, "quantizer": "l1"},
    "4bit-l1-alltoall": {"compression": "kbit", "bits": 4, "quantizer": "l1", "kbit_algorithm": "alltoall"},
    "4bit-sign-mean": {"compression": "kbit", "bits": 4, "aggregation": "mean"},
    "2bit-l1-alltoall-mean": {
        "compression": "kbit",
        "bits": 2,
        "quantizer": "l1",
        "kbit_algorithm": "alltoall",
        "aggregation": "mean",
    },
}
# one bucket for the whole model; or buckets of 1024 elements, which cut w1 (2560 elements) in three
LAYOUTS = {"one-bucket": 1 << 23, "many-buckets": sc.BUCKET_SIZE}
WORLD_SIZES = (1, 2, 3, 4)


def train(transport: ThreadTransport, pipelined: bool, bucket_size: int, options: dict[str, Any]) -> dict[str, Any]:
    """TRAIN_STEPS steps on this rank's batches; the final parameters, momenta and the collectives issued."""
    params = fresh_params()
    optimizer = ThreadLionCub(transport, list(params.items()), **scenario_settings(bucket_size=bucket_size, **options))
    optimizer.rank_step.pipelined = pipelined
    for step in range(1, sc.TRAIN_STEPS + 1):
        optimizer.zero_grad()
        sc.loss_of(params, transport.rank, step).backward()
        optimizer.step()
    return {
        "params": [param.detach().clone() for param in params.values()],
        "momenta": [optimizer.state[param]["exp_avg"].clone() for param in params.values()],
        "issued": list(getattr(transport, "issued", [])),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_pipelined_buckets_give_the_serial_steps_bits_on_every_rank(p: int, mode: str, layout: str) -> None:
    options, bucket_size = MODES[mode], LAYOUTS[layout]
    serial = on_every_rank(p, lambda transport: train(transport, False, bucket_size, options))
    pipelined = on_every_rank(
        p, lambda transport: train(transport, True, bucket_size, options), DeferredThreadTransport
    )
    for rank in range(p):
        for index, name in enumerate(sc.PARAM_SHAPES):
            assert torch.equal(pipelined[rank]["params"][index], serial[rank]["params"][index]), f"rank {rank} {name}"
            assert torch.equal(pipelined[rank]["momenta"][index], serial[rank]["momenta"][index]), f"rank {rank} {name}"
    # and both are what the brute-force simulation of the same training says
    expected_params, expected_momenta = sc.simulate_mode(p, {**options, "bucket_size": bucket_size})
    for index, name in enumerate(sc.PARAM_SHAPES):
        got = pipelined[0]["params"][index]
        if "mean" not in mode:
            assert torch.equal(got, expected_params[index]), name
        else:  # the mean modes divide sums: the reference may round differently by an ulp
            torch.testing.assert_close(got, expected_params[index], rtol=1e-5, atol=1e-6)
        for rank in range(p):
            torch.testing.assert_close(pipelined[rank]["momenta"][index], expected_momenta[rank][index])


@pytest.mark.parametrize("p", (2, 3))
def test_pipelined_step_issues_the_next_buckets_first_collective_before_the_last_ones_second(p: int) -> None:
    """The schedule really overlaps: bucket k+1's all-to-all goes out before bucket k's all-gather."""
    results = on_every_rank(
        p, lambda transport: train(transport, True, sc.BUCKET_SIZE, MODES["1bit"]), DeferredThreadTransport
    )
    issued = results[0]["issued"]
    assert all(result["issued"] == issued for result in results), "every rank issues the same collectives in order"
    # Only the buckets' collectives are issued (the checks block); the MLP makes 4 buckets of <= 1024 elements.
    one_step = ["all_to_all", "all_to_all", "all_gather", "all_to_all", "all_gather", "all_to_all", "all_gather"]
    assert issued == (one_step + ["all_gather"]) * sc.TRAIN_STEPS
