"""The packing implementations the kernel tests run on, one pytest parameter each (GPU ones marked ``gpu``)."""

from __future__ import annotations

from typing import NamedTuple

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
