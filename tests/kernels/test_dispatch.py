"""Which packing path runs: compiled op by default (logged once), DS_LIONCUB_PACKING and set_packing_path to
force one, a clear error when the forced one cannot run, and auto's fallback to the exact torch path."""

from __future__ import annotations

import io
import logging

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub._logging import get_logger
from ds_lioncub.errors import LionCubSetupError


def test_default_path_is_compiled_and_logged_once(cpu_op, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(packing.PACKING_ENV, raising=False)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    get_logger().addHandler(handler)
    try:
        packing._chosen.clear()
        assert packing.packing_path("cpu").path == "compiled"
        assert packing.packing_path("cpu").path == "compiled"
    finally:
        get_logger().removeHandler(handler)
    assert stream.getvalue().count("packing on cpu tensors: compiled path") == 1


@pytest.mark.parametrize("mode", ["torch", "compiled", "auto"])
def test_environment_variable_selects_the_path(cpu_op, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv(packing.PACKING_ENV, mode.upper())  # case does not matter
    expected = "torch" if mode == "torch" else "compiled"
    choice = packing.packing_path("cpu")
    assert choice.path == expected
    if mode != "auto":
        assert f"DS_LIONCUB_PACKING={mode}" in choice.reason


def test_bad_environment_variable_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packing.PACKING_ENV, "fastest")
    with pytest.raises(ValueError, match="auto.*compiled.*cupy.*torch"):
        packing.pack_signs(torch.ones(3))
    with pytest.raises(ValueError, match="fastest"):
        packing.set_packing_path("fastest")


def test_forcing_an_unavailable_path_raises_and_auto_falls_back() -> None:
    packing.set_packing_path("compiled")
    with pytest.raises(RuntimeError, match="compiled packing op is unavailable"):
        packing.packing_path("meta")
    packing.set_packing_path("auto")
    meta_choice = packing.packing_path("meta")
    assert meta_choice.path == "torch" and "same bits" in meta_choice.reason


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_forcing_cupy_for_tensors_it_cannot_pack_raises(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    # cupy packs CUDA memory only; forced, it used to leave CPU tensors to torch without a word, although a forced
    # path that cannot run raises.
    monkeypatch.setenv(packing.PACKING_ENV, "cupy")
    packing.set_packing_path(None)
    with pytest.raises(LionCubSetupError) as raised:
        packing.packing_path(device)
    message = str(raised.value)
    assert message.startswith("LionCub: DS_LIONCUB_PACKING=cupy") and f"{device} tensors" in message, message
    assert "DS_LIONCUB_PACKING=auto" in message and "torch" in message
    with pytest.raises(LionCubSetupError, match="CUDA tensors only"):
        packing.pack_signs(torch.ones(3))  # what training calls: the same refusal, no silent torch path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI and this CPU machine have none)")
def test_auto_on_cuda_takes_the_compiled_op_or_torch_never_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy's 1-bit step was slower than torch's on an H100 and an H200 (benchmarks/RESULTS.md, "On a GPU")."""
    monkeypatch.delenv(packing.PACKING_ENV, raising=False)
    packing._chosen.clear()
    assert packing.packing_path("cuda").path in ("compiled", "torch")
    monkeypatch.setenv(packing.PACKING_ENV, "cupy")
    pytest.importorskip("cupy", reason="cupy is not installed")
    assert packing.packing_path("cuda").path == "cupy"
