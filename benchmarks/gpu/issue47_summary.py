"""The before/after tables of benchmarks/gpu/issue47.sh, from the files its steps wrote into OUT.

    python benchmarks/gpu/issue47_summary.py OUT

Reads OUT/local_costs_{v1,v2}.json (``planner --calibrate --device cuda`` with the kernels before v2 and after)
and the ``x copy`` lines of OUT/packing_{v1,v2}.log, and writes OUT/summary.md: each local cost entry before and
after, in picoseconds per element and against the bound the planner derives from bytes over the datasheet
bandwidth of this GPU (``ds_lioncub.planner.devices.derived_gpu_costs``; the target: at most 3x), and the 1-bit
step's kernels before and after (the targets: the 1-bit step of 774M elements at most 1.5 ms on an H100, the
vote at 0.5x the copy's bandwidth or more). Missing files leave their table out.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def local_cost_rows(out: Path) -> list[str]:
    tables = {}
    for generation in ("v1", "v2"):
        path = out / f"local_costs_{generation}.json"
        if path.is_file():
            tables[generation] = json.loads(path.read_text())
    if not tables:
        return []
    measured_on = next(iter(tables.values())).get("measured_on", "")
    bound: dict[str, float] = {}
    gpu = "?"
    try:
        from ds_lioncub.planner.devices import GPU_MEMORY_BANDWIDTH, derived_gpu_costs

        gpu = next((name for name in GPU_MEMORY_BANDWIDTH if name in measured_on), "H100")
        bound = dict(derived_gpu_costs(GPU_MEMORY_BANDWIDTH[gpu], gpu).seconds_per_element)
    except Exception as error:  # noqa: BLE001 - the summary still shows the measurements
        print(f"no derived bound: {error}", file=sys.stderr)
    rows = [
        f"Local costs, ps per element ({measured_on}); bound: bytes over {gpu}'s datasheet bandwidth",
        "",
        "| entry | bound | before (v1) | x bound | after (v2) | x bound | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted({key for table in tables.values() for key in table["seconds_per_element"]})
    for key in keys:
        before = tables.get("v1", {}).get("seconds_per_element", {}).get(key)
        after = tables.get("v2", {}).get("seconds_per_element", {}).get(key)
        limit = bound.get(key)
        speedup = f"{before / after:.2f}x" if before and after else "-"
        cells = [_ps(limit), _ps(before), _times(before, limit), _ps(after), _times(after, limit), speedup]
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    return rows


def _ps(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e12:.2f}"


def _times(value: float | None, limit: float | None) -> str:
    return "-" if value is None or not limit else f"{value / limit:.2f}"


LINE = re.compile(r"n=(\S+)\s+(\S+)\s+(.+?)\s+([\d.]+) ms\s+([\d.]+) GB/s.*x copy ([\d.]+)")


def packing_rows(out: Path) -> list[str]:
    found: dict[tuple[str, str], tuple[str, str, str]] = {}
    for generation in ("v1", "v2"):
        path = out / f"packing_{generation}.log"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            match = LINE.search(line)
            if match and match.group(2) == "compiled":
                n, _, op, ms, gbps, copy = match.groups()
                found[(f"{op.strip()} (n={n})", generation)] = (ms, gbps, copy)
    if not found:
        return []
    rows = ["", "The 1-bit step's kernels (bench_packing, compiled path, p = 8)", ""]
    rows += ["| op | before ms | x copy | after ms | x copy |", "|---|---|---|---|---|"]
    for op in dict.fromkeys(op for op, _ in found):
        before, after = found.get((op, "v1"), ("-", "-", "-")), found.get((op, "v2"), ("-", "-", "-"))
        rows.append(f"| {op} | {before[0]} | {before[2]} | {after[0]} | {after[2]} |")
    return rows


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else ".")
    rows = local_cost_rows(out) + packing_rows(out)
    text = "\n".join(rows) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
