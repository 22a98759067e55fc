"""The local work of one LionCub sign-vote bucket: today's composition against the fused kernels.

For an n-element fp32 bucket (default 8 Mi elements: one parameter, one piece) it times, interleaved
round by round with ``dst.copy_(src)`` of the same n elements (the copy every ratio refers to):

- ``composition prepare``: what the step ran before the fused kernels, as ``LionCub._step_bucket``
  ran it: a fresh fp32 buffer ``c``, ``lion_direction`` into it, ``update_momentum``, ``pack_signs(c)``;
- ``composition apply``: ``unpack_signs`` into ``c``, then ``apply_update`` (weight decay on);
- ``fused prepare``: ``lion_direction_pack_signs`` (direction, momentum update and sign pack, one pass);
- ``fused apply``: ``apply_packed_signs`` (unpack and update, one pass);
- ``... step``: prepare then apply (the vote in between is left out: it is the same for both).

Both run on the compiled packing path (the composition's pack and unpack are the compiled kernels
too); ``composition*`` rows reuse one preallocated ``c`` instead of a fresh one per bucket, to separate
the first-touch page faults of a fresh 4n-byte buffer from the passes themselves.

"B/elt" is the bytes each variant reads and writes per element, counted from its passes (fp32 m, g, p;
one bit per sign): the composition's prepare is copy_ (8), mul_ (8), add_ (12), mul_ (8), add_ (12),
pack (4 + 1/8); its apply is unpack (1/8 + 4), mul_ (8), add_ (12); the fused prepare reads m, g and
writes m and the bits (12 + 1/8); the fused apply reads the bits and p and writes p (8 + 1/8). A copy_
is 8. Write-allocate reads of written lines come on top of every count alike.

    python -m benchmarks.bench_step                                    # prints the table
    python -m benchmarks.bench_step --write benchmarks/RESULTS.md      # replaces its section there
    python -m benchmarks.bench_step --numel 1048576 --reps 5           # a quick look

(from the repository root: the measurements then use this checkout's ds_lioncub).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_packing import _machine, _sync

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before ds_lioncub (and DeepSpeed) is imported
SECTION = "## Fused step kernels"

LR, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.99), 0.1
BITS = 1.0 / 8.0
BYTES_PER_ELEMENT = {
    "copy_": 8.0,
    "composition prepare": 8 + 8 + 12 + 8 + 12 + 4 + BITS,
    "composition apply": BITS + 4 + 8 + 12,
    "fused prepare": 12 + BITS,
    "fused apply": 8 + BITS,
}
BYTES_PER_ELEMENT["composition step"] = (
    BYTES_PER_ELEMENT["composition prepare"] + BYTES_PER_ELEMENT["composition apply"]
)
BYTES_PER_ELEMENT["fused step"] = BYTES_PER_ELEMENT["fused prepare"] + BYTES_PER_ELEMENT["fused apply"]


def _median_pair(
    op: Callable[[], object], copy: Callable[[], object], reps: int, device: torch.device
) -> tuple[float, float, float]:
    """Median times of ``op`` and ``copy`` and of their ratio, timed back to back in each round (on a GPU
    from a synchronised start to a synchronised end)."""
    op()
    copy()
    op_times, copy_times, ratios = [], [], []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        copy()
        _sync(device)
        t_copy = time.perf_counter() - start
        start = time.perf_counter()
        op()
        _sync(device)
        t_op = time.perf_counter() - start
        op_times.append(t_op)
        copy_times.append(t_copy)
        ratios.append(t_op / t_copy)
    return statistics.median(op_times), statistics.median(copy_times), statistics.median(ratios)


def measure(numel: int, threads: list[int], reps: int, device: torch.device) -> tuple[list[dict[str, object]], str]:
    from ds_lioncub.comm import packing
    from ds_lioncub.comm.packing import MomentumPiece, ParamPiece
    from ds_lioncub.lion import apply_update, lion_direction, update_momentum

    packing.set_packing_path("compiled")
    path = packing.packing_path(device)
    gen = torch.Generator().manual_seed(numel)
    m, g, p = (torch.randn(numel, generator=gen).to(device) for _ in range(3))
    voted = torch.randint(0, 256, (numel // 8,), generator=gen, dtype=torch.uint8).to(device)
    src, dst = torch.randn(numel, generator=gen).to(device), torch.empty(numel, device=device)
    kept_c = torch.empty(numel, device=device)
    beta1, beta2 = BETAS

    def composition_prepare(c: torch.Tensor | None = None) -> torch.Tensor:
        c = torch.empty(numel, device=device) if c is None else c
        lion_direction(m, g, beta1, out=c)
        update_momentum(m, g, beta2)
        packing.pack_signs(c, True, nbytes=numel // 8)
        return c

    def composition_apply(c: torch.Tensor | None = None) -> None:
        c = torch.empty(numel, device=device) if c is None else c
        packing.unpack_signs(voted, numel, out=c)
        apply_update(p, c, LR, WEIGHT_DECAY)

    def fused_prepare() -> None:
        packing.lion_direction_pack_signs([MomentumPiece(m, g, beta1, beta2)], True, nbytes=numel // 8)

    def fused_apply() -> None:
        packing.apply_packed_signs(voted, [ParamPiece(p, LR, WEIGHT_DECAY)])

    def composition_step() -> None:
        composition_apply(composition_prepare())  # one fresh c per bucket, as the step allocated it

    cases: dict[str, Callable[[], object]] = {
        "copy_": lambda: dst.copy_(src),
        "composition prepare": composition_prepare,
        "composition apply": composition_apply,
        "composition step": composition_step,
        "composition* step": lambda: composition_apply(composition_prepare(kept_c)),
        "fused prepare": fused_prepare,
        "fused apply": fused_apply,
        "fused step": lambda: (fused_prepare(), fused_apply()),
    }
    rows: list[dict[str, object]] = []
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        for name, op in cases.items():
            op_s, copy_s, ratio = _median_pair(op, cases["copy_"], reps, device)
            nbytes = BYTES_PER_ELEMENT[name.replace("*", "")]
            rows.append(
                {
                    "threads": nthreads,
                    "op": name,
                    "ms": op_s * 1e3,
                    "copy_ms": copy_s * 1e3,
                    "over_copy": ratio,
                    "bytes_per_element": nbytes,
                    "gb_s": nbytes * numel / op_s / 1e9,
                }
            )
    return rows, f"{path.path} ({path.reason})"


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def markdown(command: str, numel: int, rows: list[dict[str, object]], notes: dict[str, str]) -> str:
    lines = [
        SECTION,
        "",
        f"Command: `{command}`  ",
        f"Date: {notes['date']}; machine: {notes['machine']}; packing: {notes['path']}  ",
        f"Load average before / after: {notes['load_before']} / {notes['load_after']} (a shared machine: the "
        "ratios compare timings taken back to back in the same round).",
        "",
        f"One fp32 bucket of n = {numel} elements (one piece), lr {LR}, betas {BETAS}, weight decay {WEIGHT_DECAY}; "
        "medians over the rounds. `x copy_` = time over `dst.copy_(src)` of the same n elements in the same "
        "round; B/elt = bytes read + written per element by the variant's passes; GB/s = that over the time. "
        "`composition*`: one preallocated c instead of a fresh one per bucket (see the module docstring of "
        "benchmarks/bench_step.py).",
        "",
        "| threads | op | ms | x copy_ | B/elt | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['threads']} | {row['op']} | {row['ms']:.2f} | {row['over_copy']:.2f} | "
            f"{row['bytes_per_element']:.3f} | {row['gb_s']:.1f} |"
        )
    by_key = {(row["threads"], row["op"]): row for row in rows}
    lines.append("")
    for threads in dict.fromkeys(row["threads"] for row in rows):
        # ratios of the copy-relative times: each was measured against a copy_ in the same rounds
        before, after = by_key[(threads, "composition step")], by_key[(threads, "fused step")]
        kept = by_key[(threads, "composition* step")]
        fused = float(after["over_copy"])
        lines.append(
            f"- {threads} thread(s): the fused step takes {fused:.2f} copies' time for "
            f"{float(after['bytes_per_element']) / 8:.2f} copies' bytes; the composition as the step ran it "
            f"{float(before['over_copy']):.2f} copies' time ({float(before['over_copy']) / fused:.1f}x the fused "
            f"step), {float(kept['over_copy']):.2f} with c preallocated ({float(kept['over_copy']) / fused:.1f}x)."
        )
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    text = path.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=8 << 20, help="elements of the bucket (default 8 Mi)")
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 and all)")
    parser.add_argument("--reps", type=int, default=15, help="rounds per case")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the CUDA op (threads then do not matter)")
    parser.add_argument("--write", type=Path, help=f"replace the '{SECTION}' section of this markdown file")
    args = parser.parse_args()
    numel = args.numel - args.numel % 8
    device = torch.device(args.device)
    threads = args.threads or (
        [torch.get_num_threads()] if device.type == "cuda" else sorted({1, torch.get_num_threads()})
    )
    notes = {"load_before": _load(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows, path = measure(numel, threads, args.reps, device)
    notes.update(
        load_after=_load(),
        path=path,
        machine=_machine(),
    )
    command = " ".join(["python -m benchmarks.bench_step", *map(shlex.quote, sys.argv[1:])])
    section = markdown(command, numel, rows, notes)
    print(section)
    if args.write:
        write_section(args.write, section)
        print(f"wrote section '{SECTION}' of {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
