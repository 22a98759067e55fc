"""Repository-wide pytest set-up for tests/ and benchmarks/tests/: the compiled op fixtures and the derived markers.

Markers (registered in pyproject.toml, ``--strict-markers``): a module or test declares what it starts
(``distributed``, ``deepspeed``, ``mpi``, ``netns``) or needs (``gpu``); two markers are derived here so that
they cannot be forgotten:

- ``slow`` on every test that carries one of the multi-process markers, so ``pytest -m "not slow"`` is the
  fast, in-process tier;
- ``compiled`` on every test that requests the compiled op (the ``cpu_op`` or ``cuda_op`` fixture).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

MULTI_PROCESS_MARKERS = ("distributed", "deepspeed", "mpi", "netns")
COMPILED_OP_FIXTURES = ("cpu_op", "cuda_op")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in MULTI_PROCESS_MARKERS):
            item.add_marker(pytest.mark.slow)
        if any(name in getattr(item, "fixturenames", ()) for name in COMPILED_OP_FIXTURES):
            item.add_marker(pytest.mark.compiled)


@pytest.fixture(scope="session")
def packing_op_build() -> tuple[Any, BaseException | None]:
    """Build the compiled CPU packing op once per session: (module, None) or (None, error).

    Requested by the kernel tests (through ``cpu_op``) and by every fixture that starts ranks, so that
    the rank subprocesses load the prebuilt op (about a second) instead of each building it. The build is
    JIT and cached under build/torch_extensions, so later sessions only load it. If it fails, the kernel
    tests fail with the error and the rank subprocesses are told to use the torch path (same bits) rather
    than each retry the build.
    """
    from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder

    try:
        return LionCubPackingCPUBuilder().load(), None
    except Exception as error:  # noqa: BLE001 - reported by the kernel tests
        os.environ["DS_LIONCUB_PACKING"] = "torch"
        return None, error


@pytest.fixture(scope="session")
def cpu_op(packing_op_build: tuple[Any, BaseException | None]) -> Any:
    """The compiled CPU packing op; a failed build fails the test (a compiler is present wherever tests run)."""
    module, error = packing_op_build
    if error is not None:
        pytest.fail(f"the CPU packing op did not build: {type(error).__name__}: {error}", pytrace=False)
    return module


@pytest.fixture(scope="session")
def cuda_op() -> Any:
    """The compiled CUDA packing op (for the ``gpu`` tests, which skip without a CUDA device)."""
    from ds_lioncub.kernels.builders import LionCubPackingCUDABuilder

    builder = LionCubPackingCUDABuilder()
    if not builder.is_compatible():
        pytest.fail(f"CUDA device present but the CUDA op cannot build: {builder.error_log}", pytrace=False)
    return builder.load()
