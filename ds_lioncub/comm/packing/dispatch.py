"""Which packing implementation serves the tensors of a device type, chosen once and cached.

``auto`` (the default) takes the compiled op (:mod:`ds_lioncub.kernels.compiled`) where it builds and loads, else pure
torch (:mod:`.torch_impl`). A compiled op that fails to build or load is logged as a warning with the
reason: every implementation gives the same bytes, so a failed build costs speed, never a result.
cupy (:mod:`.cupy_impl`, for CUDA tensors) runs only when asked for: measured on an H100 and an H200
(benchmarks/RESULTS.md, "On a GPU"), its 1-bit step of 774M elements took 18.4 and 16.1 ms against
torch's 15.9 and 12.2 (the compiled op: 4.2 and 3.9), so ``auto`` never prefers it.
``DS_LIONCUB_PACKING=auto|compiled|cupy|torch`` (or :func:`set_packing_path`) overrides the choice;
forcing ``compiled`` where it cannot run, or ``cupy`` where it cannot (without cupy, or for tensors
that are not CUDA tensors: cupy packs CUDA memory only), raises
:class:`~ds_lioncub.errors.LionCubSetupError` instead of falling back. The choice and its reason
are logged once per device type and requested mode and shown by ``python -m ds_lioncub.report``.

The compiled and cupy implementations are handed out wrapped in
:class:`~ds_lioncub.kernels.self_check.SelfCheckedPacking`: each dtype they are asked to handle is first checked
against the torch implementation, and a mismatch raises instead of computing (:mod:`ds_lioncub.kernels.self_check`).
The torch implementation is the reference and runs unwrapped.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.packing.cupy_impl import CupyPacking
from ds_lioncub.comm.packing.layout import PackingOps
from ds_lioncub.comm.packing.torch_impl import TorchPacking
from ds_lioncub.errors import LionCubConfigError, LionCubSetupError
from ds_lioncub.kernels.compiled import KERNELS_ENV, CompiledPacking
from ds_lioncub.kernels.self_check import SelfCheckedPacking

PACKING_ENV = "DS_LIONCUB_PACKING"
PACKING_MODES = ("auto", "compiled", "cupy", "torch")

# Stateless: one instance serves every device type, and the compiled implementation's fallback.
_TORCH = TorchPacking()


class PackingPath(NamedTuple):
    """The packing path for one device type, why it was chosen, and the implementation that runs it.

    "Path" is the word users see (``DS_LIONCUB_PACKING``, :func:`packing_path`, the report's "active
    path"), so the record keeps it; ``ops`` is the implementation object the public functions call.
    """

    path: str  # "compiled", "cupy" or "torch"
    reason: str
    ops: PackingOps
    module: Any = None  # the compiled op module or the cupy module
    degraded: bool = False  # the compiled op should have loaded here but failed (logged as a warning)


_override: str | None = None
# (device type, mode, where the mode came from) -> choice. Mutated, never rebound: it is also
# ``ds_lioncub.comm.packing._chosen``.
_chosen: dict[tuple[str, str, str], PackingPath] = {}


def set_packing_path(mode: str | None) -> None:
    """Override ``DS_LIONCUB_PACKING`` for this process (``None`` goes back to the variable)."""
    global _override
    if mode is not None:
        _validate_mode(mode, "set_packing_path")
    _override = mode


def _validate_mode(mode: str, origin: str) -> str:
    if mode not in PACKING_MODES:
        raise LionCubConfigError(f"{origin}={mode!r}: the packing path must be one of {list(PACKING_MODES)}")
    return mode


def requested_mode() -> str:
    """The requested mode: :func:`set_packing_path`, else ``DS_LIONCUB_PACKING``, else "auto"."""
    if _override is not None:
        return _override
    value = os.environ.get(PACKING_ENV, "").strip().lower() or "auto"
    return _validate_mode(value, PACKING_ENV)


def packing_path(device: torch.device | str = "cpu") -> PackingPath:
    """The path used for tensors on ``device`` (loading, or JIT-building once, the compiled op)."""
    device_type = torch.device(device).type
    mode = requested_mode()
    # The reason of a forced choice names where the mode came from, so that is part of the key: a choice
    # made under set_packing_path must not be reported later as the environment variable's.
    key = (device_type, mode, _origin())
    choice = _chosen.get(key)
    if choice is None:
        choice = _choose(device_type, mode)
        _chosen[key] = choice
        log = get_logger().warning if choice.degraded else get_logger().info
        log(f"packing on {device_type} tensors: {choice.path} path ({choice.reason})")
    return choice


def ops_for(tensor: torch.Tensor) -> PackingOps:
    """The implementation for ``tensor``'s device (the requested mode is read on every call)."""
    return packing_path(tensor.device).ops


def _origin() -> str:
    return "set_packing_path" if _override is not None else PACKING_ENV


def _choose(device_type: str, mode: str) -> PackingPath:
    if mode == "torch":
        return PackingPath("torch", f"{_origin()}=torch", _TORCH)
    notes = []
    degraded = False
    if mode in ("auto", "compiled"):
        compiled, why = _load_compiled(device_type)
        degraded = compiled is None and why.startswith("loading the op failed")
        if compiled is not None:
            forced = f"{_origin()}=compiled; " if mode == "compiled" else ""
            name = f"compiled op {getattr(compiled, '__name__', type(compiled).__name__)}"
            kernels = CompiledPacking(compiled, _TORCH)
            identity: Any = compiled
            if kernels.generation == "v1":  # the CUDA op's kernels before v2, checked apart from the others
                name += f" ({KERNELS_ENV}=v1: its kernels before v2)"
                why += f"; {KERNELS_ENV}=v1: the kernels before v2"
                identity = (compiled, "v1")
            ops = SelfCheckedPacking(kernels, name, device_type, identity)
            return PackingPath("compiled", forced + why, ops, compiled)
        if mode == "compiled":
            raise LionCubSetupError(f"{_origin()}=compiled, but the compiled packing op is unavailable: {why}")
        notes.append(f"compiled op unavailable: {why}")
    if mode == "cupy":
        cupy, why = _load_cupy(device_type)
        if cupy is not None:
            ops = SelfCheckedPacking(CupyPacking(cupy), f"cupy {cupy.__version__}", device_type, cupy)
            return PackingPath("cupy", f"{_origin()}=cupy; {why}", ops, cupy)
        # Forced, it runs or raises, whatever the device: a job that asked for cupy and silently packed its
        # CPU tensors with torch would report a path it never ran.
        if device_type != "cuda":
            raise LionCubSetupError(
                f"LionCub: {_origin()}=cupy, but these are {device_type} tensors and cupy packs CUDA tensors only; "
                f"set {_origin()}=auto (the fastest path that runs), compiled or torch"
            )
        raise LionCubSetupError(f"{_origin()}=cupy, but cupy is unavailable: {why}")
    return PackingPath("torch", "; ".join(notes) + "; the pure torch path gives the same bits", _TORCH, None, degraded)


def _load_compiled(device_type: str) -> tuple[Any, str]:
    """(module, how it was loaded) or (None, why not)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return None, "no CUDA device"
    if device_type not in ("cpu", "cuda"):
        return None, f"no kernels for {device_type} tensors"
    try:
        # Imported here, not at the top: only the compiled path needs DeepSpeed's op-builder machinery.
        from ds_lioncub.kernels.builders import builders

        builder = builders()[device_type]
        if not builder.is_compatible():
            return None, f"op {builder.name} is not compatible here: {builder.error_log}"
        module = builder.load()
    except Exception as error:  # noqa: BLE001 - a failed build must not stop training: the torch path is exact
        lines = str(error).strip().splitlines() or [""]
        return None, f"loading the op failed: {type(error).__name__}: {lines[0][:300]}"
    extra = f", {module.simd()}, {torch.get_num_threads()} threads" if device_type == "cpu" else ""
    return module, f"op {builder.name} from {builder.load_source}{extra}"


def _load_cupy(device_type: str) -> tuple[Any, str]:
    """(the cupy module, what it does) or (None, why not)."""
    if device_type != "cuda":
        return None, "cupy handles CUDA tensors only"
    try:
        import cupy
    except Exception as error:  # noqa: BLE001 - an installed cupy can fail in many ways (CUDA driver/runtime)
        return None, f"not importable ({type(error).__name__}: {error})"
    return cupy, f"cupy {cupy.__version__} packbits/unpackbits for the 1-bit layouts, torch for the rest"


__all__ = [
    "PACKING_ENV",
    "PACKING_MODES",
    "PackingPath",
    "ops_for",
    "packing_path",
    "requested_mode",
    "set_packing_path",
]
