"""The packing implementations the kernel tests run on, one pytest parameter each (GPU ones marked ``gpu``),
and the compiled op loaded for a test or the test skipped with the reason."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch


class Implementation(NamedTuple):
    """A device and the packing path forced on it (``ds_lioncub.comm.packing.set_packing_path``)."""

    device: str
    path: str

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)


IMPLEMENTATIONS = [
    pytest.param(Implementation("cpu", "torch"), id="cpu-torch"),
    pytest.param(Implementation("cpu", "compiled"), id="cpu-compiled"),
    pytest.param(Implementation("cuda", "torch"), id="cuda-torch", marks=pytest.mark.gpu),
    pytest.param(Implementation("cuda", "compiled"), id="cuda-compiled", marks=pytest.mark.gpu),
    pytest.param(Implementation("cuda", "cupy"), id="cuda-cupy", marks=pytest.mark.gpu),
]


def load_op_or_skip(builder: Any) -> Any:
    """``builder.load()``, or skip the test saying why the op cannot be built in this process."""
    if not builder.is_compatible():
        pytest.skip(f"op {builder.name} cannot build here: {builder.error_log}")
    try:
        return builder.load()
    except Exception as error:  # noqa: BLE001 - any build failure means "not available in this process"
        pytest.skip(f"op {builder.name} did not build: {type(error).__name__}: {error}")
