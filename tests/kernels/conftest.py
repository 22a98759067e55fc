"""Every kernel test starts from the packing path the environment selects: a test that forces one with
``set_packing_path`` has it undone afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import ds_lioncub.comm.packing as packing


@pytest.fixture(autouse=True)
def _reset_packing_path() -> Iterator[None]:
    yield
    packing.set_packing_path(None)
