"""When one of LionCub's collectives returns, gloo's worker thread no longer holds any tensor it was handed.

Otherwise the worker drops its references later, taking the GIL to release the tensors' Python objects, and
if the rank is exiting by then CPython ends the worker inside a noexcept frame: the rank aborts with
"terminate called without an active exception" (-6) after its work is done
(ds_lioncub/comm/transport/released.py). Two real gloo ranks (tests/workers/release_scenarios.py) call
every transport collective, plain and issued, whole and segmented, 200 times each, and read the reference
counts of everything they handed over right after each call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

WORKER = REPO / "tests" / "workers" / "release_scenarios.py"
COLLECTIVES = (
    "all_to_all",
    "all_gather",
    "all_reduce_sum",
    "start_all_to_all",
    "start_all_gather",
    "start_all_reduce_sum",
    "segmented_all_to_all",
    "segmented_all_gather",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> list[dict[str, Any]]:
    return run_ranks(WORKER, 2, Path(tmp_path_factory.mktemp("released")), timeout_s=300)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_nothing_handed_to_gloo_is_still_held_when_the_collective_returns(
    ranks: list[dict[str, Any]], collective: str
) -> None:
    for rank, results in enumerate(ranks):
        counts = results[collective]
        assert counts["handed"] >= 200, f"rank {rank}: {collective} handed gloo nothing: {counts}"
        control = results["control_plain_all_reduce"]
        assert counts["held"] == 0, (
            f"rank {rank}: {counts['held']} of the {counts['handed']} tensors {collective} handed to gloo were "
            f"still held when it returned (plain all_reduce on this machine just now: {control['held']} of "
            f"{control['handed']})"
        )
