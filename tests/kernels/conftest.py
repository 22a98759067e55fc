"""Every kernel test starts from the packing path the environment selects: a test that forces one with
``set_packing_path`` has it undone afterwards. ``impl`` runs a test once per packing implementation
(tests/support/implementations.py), skipping, with the reason, those this process cannot run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder, LionCubPackingCUDABuilder
from tests.support.implementations import IMPLEMENTATIONS, Implementation, load_op_or_skip


@pytest.fixture(autouse=True)
def _reset_packing_path() -> Iterator[None]:
    yield
    packing.set_packing_path(None)


@pytest.fixture(scope="module")
def cpu_op() -> Any:
    return load_op_or_skip(LionCubPackingCPUBuilder())


@pytest.fixture(scope="module")
def cuda_op() -> Any:
    return load_op_or_skip(LionCubPackingCUDABuilder())


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> Iterator[Implementation]:
    """Forces one implementation for the test; skips (saying why) where this process cannot run it."""
    chosen: Implementation = request.param
    if chosen.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    if chosen.path == "compiled":
        request.getfixturevalue(f"{chosen.device}_op")
    if chosen.path == "cupy":
        pytest.importorskip("cupy", reason="cupy is not installed")
    packing.set_packing_path(chosen.path)
    try:
        assert packing.packing_path(chosen.device).path == chosen.path
        yield chosen
    finally:
        packing.set_packing_path(None)
