"""Shared fixtures: one real gloo job per world size, run once per session, results checked by many tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from launch import run_ranks  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda p: f"p{p}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Results of tests/workers/run_scenarios.py on ``p`` real gloo ranks, one dict per rank."""
    work_dir = tmp_path_factory.mktemp(f"scenarios-p{request.param}")
    return run_ranks(TESTS / "workers" / "run_scenarios.py", request.param, work_dir)


@pytest.fixture(scope="session", autouse=True)
def packing_op_build() -> tuple[object, BaseException | None]:
    """Build the compiled CPU packing op once, before any test: (module, None) or (None, error).

    The build is JIT and cached under build/torch_extensions, so later sessions and every rank
    subprocess only load it (about a second). If it fails, tests/test_kernels.py fails with the
    error; the rank subprocesses are told to use the torch path rather than each retry the build.
    """
    from ds_lioncub.op_builder import LionCubPackingCPUBuilder

    try:
        return LionCubPackingCPUBuilder().load(), None
    except Exception as error:  # noqa: BLE001 - reported by the kernel tests
        os.environ["DS_LIONCUB_PACKING"] = "torch"
        return None, error
