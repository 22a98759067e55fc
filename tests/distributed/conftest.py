"""The gloo jobs of this tier: one real job per world size, run once per session, its results checked by many tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.launch import REPO, run_ranks

WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda p: f"p{p}")
def ranks(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    packing_op_build: tuple[Any, BaseException | None],
) -> list[dict[str, Any]]:
    """Results of tests/workers/run_scenarios.py on ``p`` real gloo ranks, one dict per rank."""
    work_dir = tmp_path_factory.mktemp(f"scenarios-p{request.param}")
    return run_ranks(REPO / "tests" / "workers" / "run_scenarios.py", request.param, work_dir)
