"""Capture what the multi-rank scenario workers compute, and compare two captures bit for bit.

A refactoring that must not change behaviour is checked by capturing before it and after it:

  python -m tests.support.behaviour_capture capture OUT.pt [--parts scenarios,hybrid,zero3_hybrid,engine]
  python -m tests.support.behaviour_capture compare A.pt B.pt

``capture`` runs the scenario workers the way their tests do (tests/support/launch.py) and saves every
rank's results dict:

- ``scenarios``: tests/workers/run_scenarios.py on 1, 2, 3 and 4 gloo ranks (``run_ranks``, as
  tests/distributed/conftest.py does);
- ``hybrid``: tests/workers/hybrid_scenarios.py, its "main" then its "resume" phase, on 4 ranks under the
  real ``deepspeed`` launcher (``run_deepspeed``, as tests/integration/test_zero_hybrid.py does);
- ``zero3_hybrid``: tests/workers/zero3_hybrid_scenarios.py the same way (as
  tests/integration/test_zero3_hybrid.py does);
- ``engine``: tests/workers/ds_engine_scenarios.py, "main" on 2 ranks then "resume" on 3
  (as tests/integration/test_deepspeed_engine.py does); it covers the DeepSpeed wiring, the set-up
  checks and the checkpoint code.

The packing path is whatever ``DS_LIONCUB_PACKING`` says (the compiled op by default, built once here
first so the ranks load it instead of each building it).

``compare`` walks both captures: every key must be in both, tensors must have the same dtype, shape and
bytes (stricter than ``torch.equal``: -0.0 is not 0.0 and a NaN equals itself only with the same
bits), floats the same bits, everything else ``==``; dicts, lists, tuples and dataclasses are compared
member by member. It prints how many values it compared and every mismatch, and exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.support.launch import REPO, run_deepspeed, run_ranks

SCENARIO_WORLD_SIZES = (1, 2, 3, 4)
HYBRID_WORLD = 4
ENGINE_MAIN_WORLD = 2
ENGINE_RESUME_WORLD = 3
PARTS: dict[str, Callable[[Path], dict[str, Any]]] = {}  # filled below: part name -> capture function
WORK_DIR_MARK = "<work>"

# Left out of the comparison, by name, because they differ between two runs of the same code:
# - dataclass fields that are wall-clock timings (CommStats.seconds; the telemetry's per-step and total
#   seconds): two runs move the same bytes but never take the same time;
TIMING_FIELDS = {
    ("CommStats", "seconds"),
    ("StepRecord", "comm_seconds"),
    ("StepRecord", "local_seconds"),
    ("TelemetryTotals", "comm_seconds"),
    ("TelemetryTotals", "local_seconds"),
}
# - dict keys holding a Python traceback: it quotes source lines and their line numbers, which move with
#   any edit of the code (the error message itself, recorded under its own key, is compared).
TRACEBACK_KEY_SUFFIX = "traceback"


# ---------------------------------------------------------------------------------------------- capture


def _replace_strings(value: Any, old: str, new: str) -> Any:
    """``value`` with ``old`` replaced by ``new`` in every string inside it (dicts, lists, tuples)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {key: _replace_strings(item, old, new) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace_strings(item, old, new) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_replace_strings(item, old, new) for item in value)
    return value


def _capture_scenarios(work: Path) -> dict[str, Any]:
    script = REPO / "tests" / "workers" / "run_scenarios.py"
    return {
        f"scenarios/p{world}": run_ranks(script, world, work / f"scenarios-p{world}", timeout_s=1800)
        for world in SCENARIO_WORLD_SIZES
    }


def _launch_phases(
    work: Path, script_name: str, phases: list[tuple[str, int, list[str]]], timeout_s: float
) -> dict[str, Any]:
    """Each ``(phase, ranks, extra arguments)`` launched in turn into ``work``; each rank's saved results."""
    script = REPO / "tests" / "workers" / script_name
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for phase, world, extra in phases:
        files = [work / f"{phase}-rank{rank}.pt" for rank in range(world)]
        run_deepspeed(script, world, ["--out", str(work), "--phase", phase, *extra], files, timeout_s=timeout_s)
        results[phase] = [torch.load(path, weights_only=False) for path in files]
    return results


def _capture_hybrid(work: Path) -> dict[str, Any]:
    phases = [("main", HYBRID_WORLD, []), ("resume", HYBRID_WORLD, [])]
    launched = _launch_phases(work / "hybrid", "hybrid_scenarios.py", phases, timeout_s=3600)
    return {f"hybrid/{phase}": ranks for phase, ranks in launched.items()}


def _capture_zero3_hybrid(work: Path) -> dict[str, Any]:
    phases = [("main", HYBRID_WORLD, []), ("resume", HYBRID_WORLD, [])]
    launched = _launch_phases(work / "zero3_hybrid", "zero3_hybrid_scenarios.py", phases, timeout_s=3600)
    return {f"zero3_hybrid/{phase}": ranks for phase, ranks in launched.items()}


def _capture_engine(work: Path) -> dict[str, Any]:
    out = work / "engine"
    phases = [
        ("main", ENGINE_MAIN_WORLD, ["--deepspeed_config", "configs/lioncub_1bit.json"]),
        ("resume", ENGINE_RESUME_WORLD, ["--checkpoint", str(out / "ckpt-lioncub_1bit")]),
    ]
    launched = _launch_phases(out, "ds_engine_scenarios.py", phases, timeout_s=3600)
    return {f"engine/{phase}": ranks for phase, ranks in launched.items()}


PARTS.update(
    scenarios=_capture_scenarios, hybrid=_capture_hybrid, zero3_hybrid=_capture_zero3_hybrid, engine=_capture_engine
)


def _build_packing_op() -> str:
    """Build (or load) the compiled CPU op once unless the torch path is asked for; the mode requested."""
    requested = os.environ.get("DS_LIONCUB_PACKING", "auto")
    if requested != "torch":
        from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder

        LionCubPackingCPUBuilder().load()  # a failed build raises: a "compiled" capture must not fall back
    return requested


def capture(out: Path, parts: list[str]) -> None:
    requested = _build_packing_op()
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="behaviour-capture-"))
    try:
        for part in parts:
            began = time.monotonic()
            captured = PARTS[part](work)
            # Error messages may name files under the scratch directory, which differs from run to run.
            results.update(_replace_strings(captured, str(work), WORK_DIR_MARK))
            print(f"captured {part} in {time.monotonic() - began:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {"packing": requested, "parts": parts, "torch": torch.__version__, "repo": str(REPO)}
    torch.save({"meta": meta, "results": results}, out)
    print(f"saved {out} ({', '.join(parts)}; packing {requested})")


# ---------------------------------------------------------------------------------------------- compare


@dataclasses.dataclass
class Comparison:
    """The running tally of a comparison: values compared, and one line per mismatch."""

    compared: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)

    def leaf(self, path: str, same: bool, detail: str) -> None:
        self.compared += 1
        if not same:
            self.mismatches.append(f"{path}: {detail}")


def _same_bits(first: float, second: float) -> bool:
    return struct.pack("<d", first) == struct.pack("<d", second)


def _tensor_difference(first: torch.Tensor, second: torch.Tensor) -> str | None:
    """None when both tensors hold the same bytes in the same dtype and shape; else what differs."""
    if first.dtype != second.dtype or first.shape != second.shape:
        return f"{first.dtype} {tuple(first.shape)} vs {second.dtype} {tuple(second.shape)}"
    if first.layout != torch.strided or second.layout != torch.strided:
        return None if torch.equal(first, second) else "sparse tensors differ"
    first_bytes = first.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    second_bytes = second.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(first_bytes, second_bytes):
        return None
    return f"{int((first_bytes != second_bytes).sum())} of {first_bytes.numel()} bytes differ"


def _walk(first: Any, second: Any, path: str, tally: Comparison) -> None:
    if type(first) is not type(second):
        tally.leaf(path, False, f"type {type(first).__name__} vs {type(second).__name__}")
    elif isinstance(first, torch.Tensor):
        difference = _tensor_difference(first, second)
        tally.leaf(path, difference is None, difference or "")
    elif isinstance(first, dict):
        for key in sorted(first.keys() | second.keys(), key=repr):
            where = f"{path}/{key}" if path else str(key)
            if isinstance(key, str) and key.endswith(TRACEBACK_KEY_SUFFIX):
                continue  # see TRACEBACK_KEY_SUFFIX
            if key not in second:
                tally.leaf(where, False, "only in the first capture")
            elif key not in first:
                tally.leaf(where, False, "only in the second capture")
            else:
                _walk(first[key], second[key], where, tally)
    elif isinstance(first, list | tuple):
        if len(first) != len(second):
            tally.leaf(path, False, f"length {len(first)} vs {len(second)}")
            return
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            _walk(a, b, f"{path}[{index}]", tally)
    elif dataclasses.is_dataclass(first) and not isinstance(first, type):
        name = type(first).__name__
        for field in dataclasses.fields(first):
            if (name, field.name) not in TIMING_FIELDS:  # see TIMING_FIELDS
                _walk(getattr(first, field.name), getattr(second, field.name), f"{path}.{field.name}", tally)
    elif isinstance(first, float):
        tally.leaf(path, _same_bits(first, second), f"{first!r} vs {second!r}")
    elif isinstance(first, str | int | bool | bytes | type(None)):
        tally.leaf(path, first == second, f"{first!r} vs {second!r}")
    else:
        # An object without its own __eq__ compares by identity, which two loaded files never share: a
        # capture that holds one needs a rule here first.
        if type(first).__eq__ is object.__eq__:
            tally.leaf(path, False, f"cannot compare a {type(first).__name__} (no __eq__)")
        else:
            tally.leaf(path, bool(first == second), f"{first!r} vs {second!r}")


def compare(first_path: Path, second_path: Path, shown: int = 200) -> int:
    first = torch.load(first_path, weights_only=False)
    second = torch.load(second_path, weights_only=False)
    print(f"A: {first_path} {first['meta']}")
    print(f"B: {second_path} {second['meta']}")
    tally = Comparison()
    _walk(first["results"], second["results"], "", tally)
    for line in tally.mismatches[:shown]:
        print(f"MISMATCH {line}")
    if len(tally.mismatches) > shown:
        print(f"... and {len(tally.mismatches) - shown} more")
    print(f"compared {tally.compared} values: {len(tally.mismatches)} mismatches")
    return 1 if tally.mismatches else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.behaviour_capture", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    capture_parser = commands.add_parser("capture", help="run the scenario workers and save every rank's results")
    capture_parser.add_argument("out", type=Path)
    capture_parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    compare_parser = commands.add_parser("compare", help="compare two captures bit for bit")
    compare_parser.add_argument("first", type=Path)
    compare_parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "capture":
        parts = [part for part in args.parts.split(",") if part]
        unknown = [part for part in parts if part not in PARTS]
        if unknown:
            parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
        capture(args.out, parts)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
