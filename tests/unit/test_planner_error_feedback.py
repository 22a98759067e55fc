"""The planner's price of error feedback (docs/design.md, section 4.8): EF21's all-gather per bucket and both
forms' local passes, against the same mode without feedback, with the differences written out here."""

from __future__ import annotations

import pytest

from ds_lioncub.planner import DEFAULT_LOCAL_COSTS, Cluster, Network
from ds_lioncub.planner.model import Candidate, flat_candidate

L1_A2A = {"compression": "kbit", "bits": 2, "quantizer": "l1", "kbit_algorithm": "alltoall"}
NUM_PARAMS, BUCKET = 5_000_000, 1 << 21  # three buckets (2 full, 1 partial)
CLUSTER = Cluster(8, 1)  # 8 voters, one per node
NETWORK = Network(125e6, latency=50e-6)  # 1 Gbit/s


def candidate(params: dict[str, object]) -> Candidate:
    return flat_candidate("mode", params, NUM_PARAMS, CLUSTER, NETWORK, DEFAULT_LOCAL_COSTS, BUCKET)


@pytest.mark.parametrize(("kind", "passes"), [("residual", 2.4), ("ef21", 3.0)])
def test_local_passes_cost_lion_updates_per_element(kind: str, passes: float) -> None:
    plain, fed_back = candidate(L1_A2A), candidate({**L1_A2A, "error_feedback": {"kind": kind}})
    lion_update = DEFAULT_LOCAL_COSTS.seconds_per_element["lion_update"]
    assert fed_back.local_seconds - plain.local_seconds == pytest.approx(passes * lion_update * NUM_PARAMS)


def test_ef21_adds_one_small_all_gather_per_bucket_and_the_residual_no_bytes() -> None:
    plain = candidate(L1_A2A)
    ef21 = candidate({**L1_A2A, "error_feedback": {"kind": "ef21"}})
    residual = candidate({**L1_A2A, "error_feedback": {"kind": "residual"}})
    buckets, p = 3, CLUSTER.world_size
    # Each rank sends its 4-byte spread to the p - 1 others once per bucket (a ring all-gather).
    assert ef21.bytes_per_step_per_rank - plain.bytes_per_step_per_rank == buckets * 4 * (p - 1)
    # ... and waits for its p - 1 rounds of latency each time at least.
    assert ef21.comm_seconds - plain.comm_seconds >= buckets * (p - 1) * NETWORK.latency
    assert residual.bytes_per_step_per_rank == plain.bytes_per_step_per_rank
    assert residual.comm_seconds == plain.comm_seconds
