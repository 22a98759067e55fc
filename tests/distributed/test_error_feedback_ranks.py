"""Error feedback on real gloo ranks (p = 1-4): every form of ``scenarios.error_feedback_modes`` equal, bit for bit,
to the plain loop of tests/support/error_feedback_reference.py and to the virtual world on the same gradients.

The gloo jobs of tests/distributed/conftest.py trained those modes (pipelined and serial bucket schedules) in the
launch the distributed tier runs anyway; nothing is launched here.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.test_virtual_world_vs_ranks import virtual_run
from tests.support import scenarios as sc
from tests.support.checks import trained_mode_equals_reference
from tests.support.error_feedback_reference import simulate_ef
from tests.support.scenario_optimizer import scenario_settings

pytestmark = pytest.mark.distributed


def test_each_form_equals_the_plain_loop_and_the_virtual_world_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    init = sc.init_params()
    for mode, options in sc.error_feedback_modes(p).items():
        expected = simulate_ef(
            list(init.values()),
            lambda worker, step, params: sc.model_grads(params, worker, step),
            p,
            sc.TRAIN_STEPS,
            scenario_settings(**options),
        )
        trained_mode_equals_reference(ranks, "ef/", mode, expected.params, expected.momenta, virtual_run(p, options))


# The scenarios' buckets at bucket_size 1024 (design section 9): w1 (2560) cut in three, then b1, w2, b2 joining
# where they fit: [w1 0:1024], [w1 1024:2048], [w1 2048:2560, b1], [w2, b2].
BUCKET_PIECES = [1, 1, 2, 2]


def test_ef21_adds_one_all_gather_of_4_bytes_per_piece_and_the_residual_nothing(ranks: list[dict[str, Any]]) -> None:
    """Counted on the real ranks against the same modes without feedback: EF21 adds one all-gather per bucket
    of one fp32 spread per piece (each rank sends 4 bytes per piece to p - 1 ranks); the residual form
    changes only what its fields carry."""
    p = len(ranks)
    gathers = len(BUCKET_PIECES) if p > 1 else 0  # a world of one has no collectives
    extra_bytes = sum(4 * pieces * (p - 1) for pieces in BUCKET_PIECES)
    for rank in range(p):
        for step in range(1, sc.TRAIN_STEPS + 1):
            plain = ranks[rank][f"train-stats/4bit-l1-alltoall/{step}"]
            ef21 = ranks[rank][f"ef/train-stats/ef21-4bit/{step}"]
            assert ef21.collectives == plain.collectives + gathers, (rank, step)
            assert ef21.bytes_sent == plain.bytes_sent + extra_bytes, (rank, step)
            plain_mean = ranks[rank][f"train-stats/2bit-l1-alltoall-mean/{step}"]
            residual = ranks[rank][f"ef/train-stats/ef-residual-2bit-a2a-mean/{step}"]
            assert (residual.collectives, residual.bytes_sent) == (plain_mean.collectives, plain_mean.bytes_sent)
