"""``python -m ds_lioncub.report``: which packing path is active and why (in the spirit of ``ds_report``).

For a compiled or cupy path it also runs the self-check (:mod:`ds_lioncub.kernels.self_check`)
for the dtypes training uses and shows whether it passed, or what did not match.

By default the report resolves the path exactly as training would, so on a fresh checkout it may
JIT-build the CPU op once (10-45 s on 2 cores; later runs reuse the cache). ``--no-build`` only looks:
it reports whether a prebuilt module or a JIT cache exists and what ``auto`` would try.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

GREEN, RED, YELLOW, END = "\033[92m", "\033[91m", "\033[93m", "\033[0m"


def _mark(ok: bool | None, color: bool) -> str:
    text = {True: "[YES]", False: "[NO]", None: "[--]"}[ok]
    if not color:
        return text
    return {True: GREEN, False: RED, None: YELLOW}[ok] + text + END


def _line(label: str, value: str) -> str:
    return f"{label} {'.' * max(2, 28 - len(label))} {value}"


RULE = "-" * 78


def report(build: bool = True, color: bool | None = None) -> str:
    """The report as text (see the module docstring)."""
    from ds_lioncub.comm import packing

    if color is None:
        color = sys.stdout.isatty()
    lines = [RULE, "ds_lioncub packing report", RULE, *_versions()]
    try:
        mode = packing.requested_mode()
    except ValueError as error:
        lines.append(_line("requested mode", f"invalid: {error}"))
        return "\n".join(lines)
    from_env = os.environ.get(packing.PACKING_ENV)
    origin = f"{packing.PACKING_ENV}={from_env}" if from_env else "default"
    lines.append(_line("requested mode", f"{mode} ({origin}; choices {'|'.join(packing.PACKING_MODES)})"))
    lines += [RULE, *_ops(color), RULE]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lines += _active_paths(devices) if build else _predicted_paths(devices, mode)
    if not torch.cuda.is_available():
        lines.append(_line("active path (cuda)", "n/a: no CUDA device"))
    lines.append(RULE)
    return "\n".join(lines)


def _versions() -> list[str]:
    """Versions, where the kernel sources are, and where JIT builds go."""
    import deepspeed

    import ds_lioncub
    from ds_lioncub.kernels.builders import default_build_root, ops_dir

    root = default_build_root()
    return [
        _line("ds_lioncub", f"{getattr(ds_lioncub, '__version__', '?')} ({Path(ds_lioncub.__file__).parent})"),
        _line("torch", f"{torch.__version__} (cuda {torch.version.cuda}, {torch.get_num_threads()} threads)"),
        _line("deepspeed", deepspeed.__version__),
        _line("kernel sources", str(ops_dir() / "csrc")),
        _line("JIT cache root", str(root) if root else "torch default (~/.cache/torch_extensions)"),
    ]


def _ops(color: bool) -> list[str]:
    """Each op: can it build here, is it prebuilt or in the JIT cache; and whether cupy imports."""
    from ds_lioncub.kernels.builders import builders

    lines = []
    for builder in builders().values():
        compatible = builder.is_compatible()
        why = "" if compatible else f"  {builder.error_log}"
        lines.append(_line(f"op {builder.name}", f"compatible {_mark(compatible, color)}{why}"))
        if compatible:
            prebuilt = _mark(builder.prebuilt_available(), color)
            lines.append(_line("  prebuilt module", f"{prebuilt} {builder.absolute_name()}"))
            lines.append(_line("  JIT cache", f"{_mark(builder.jit_cached(), color)} {builder.jit_build_dir()}"))
    try:
        import cupy

        lines.append(_line("cupy", f"{cupy.__version__}"))
    except Exception as error:  # noqa: BLE001 - any import failure means "no cupy"
        lines.append(_line("cupy", f"{_mark(False, color)} not importable ({type(error).__name__})"))
    return lines


def _active_paths(devices: list[str]) -> list[str]:
    """The path each device type takes, resolved as training resolves it (may JIT-build the op once)."""
    from ds_lioncub.comm import packing

    lines = []
    for device in devices:
        try:
            choice = packing.packing_path(device)
            lines.append(_line(f"active path ({device})", f"{choice.path.upper()}: {choice.reason}"))
        except RuntimeError as error:
            lines.append(_line(f"active path ({device})", f"ERROR: {error}"))
            continue
        lines.append(_line(f"self-check ({device})", _self_check(choice.ops)))
        lines.append(_line(f"fused step ({device})", _fused_step(choice.path, choice.module)))
    return lines


def _fused_step(path: str, module: object) -> str:
    """Whether a sign-vote bucket's local work runs as the fused kernels or as the torch composition."""
    from ds_lioncub.kernels.compiled import FUSED_STEP_DTYPES
    from ds_lioncub.kernels.self_check import dtype_name

    composition = "the torch composition (lion_direction, update_momentum, pack_signs; unpack_signs, apply_update)"
    if path != "compiled":
        return f"{composition}, on the {path} packing path"
    if not (hasattr(module, "lion_direction_pack_signs") and hasattr(module, "apply_packed_signs")):
        return f"{composition}: the loaded op predates the fused kernels (rebuild it)"
    dtypes = "/".join(dtype_name(dtype) for dtype in FUSED_STEP_DTYPES)
    return (
        f"compiled kernels, one pass each way, for {dtypes} (16-bit momentum: torch's own update after the "
        "fused pack); other dtype mixes: the torch composition; checked against it with the self-check above"
    )


def _self_check(ops: object) -> str:
    """The self-check of the active implementation against torch, run now for the dtypes training uses."""
    from ds_lioncub.kernels.self_check import TRAINING_DTYPES, SelfCheckedPacking, dtype_name

    if not isinstance(ops, SelfCheckedPacking):
        return "not needed: the torch path is the reference the others are checked against"
    try:
        results = [ops.check(dtype) for dtype in TRAINING_DTYPES]
    except Exception as error:  # noqa: BLE001 - the report shows what went wrong instead of stopping
        return f"ERROR: the check itself failed: {type(error).__name__}: {error}"
    failed = [record for record in results if record.failure is not None]
    if failed:
        return "FAILED: " + " | ".join(f"{dtype_name(record.dtype)}: {record.failure}" for record in failed)
    cases = sum(record.cases for record in results)
    milliseconds = sum(record.milliseconds for record in results)
    names = ", ".join(dtype_name(record.dtype) for record in results)
    return f"PASSED against torch: {names} ({cases} cases, {milliseconds:.0f} ms once per process)"


def _predicted_paths(devices: list[str], mode: str) -> list[str]:
    """What ``mode`` would pick for each device type, from what is on disk; loads and builds nothing."""
    from ds_lioncub.kernels.builders import builders

    lines = []
    for device in devices:
        builder = builders()[device]
        ready = builder.is_compatible() and (builder.prebuilt_available() or builder.jit_cached())
        if mode == "torch":
            guess = "TORCH (requested)"
        elif ready:
            guess = "COMPILED (prebuilt or JIT cache present)"
        elif builder.is_compatible() and mode in ("auto", "compiled"):
            guess = "COMPILED after a one-time JIT build on first use (or torch if that build fails)"
        else:
            guess = "CUPY or TORCH (no compiled op)" if device == "cuda" else "TORCH (no compiled op)"
        lines.append(_line(f"would use ({device})", guess + "  [--no-build: nothing loaded]"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_lioncub.report", description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="do not load or JIT-build the op; only look")
    parser.add_argument("--no-color", action="store_true")
    args = parser.parse_args(argv)
    print(report(build=not args.no_build, color=False if args.no_color else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
