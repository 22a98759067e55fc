"""How option clip's sketch should walk a bucket on a GPU: rows of bins per pass x the column sum's form.

    python -m benchmarks.bench_clip_passes            # on a CUDA machine (benchmarks/RESULTS.md, "Option clip")

For buckets of 8, 64 and 256 Mi fp32 elements: the time of :func:`ds_lioncub.step.clipping.gradient_sketch`
as it is (on a GPU, since 2026-11-27, 1,024 rows a pass; before, 256 as on a CPU), and of the bucket's whole
rows sketched in passes of 256, 1,024 or 4,096 rows, each pass a product with the signs and one of several
column sums into fp64, as a ratio to the former; with each variant's largest difference from the sketch as
it is (relative to its largest bin) and whether it repeats bit for bit. The tail of a bucket (under one row)
is left out of the variants: it is the same few elements in each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.timing import median_seconds
from ds_lioncub.step.clipping import SIGN_PERIOD, gradient_sketch, sign_offset, sign_table

BINS = 4093
SIZES = (1 << 23, 1 << 26, 1 << 28)
ROWS_PER_PASS = (256, 1024, 4096)
Reduction = Callable[[torch.Tensor], torch.Tensor]


def _two_stage(m: torch.Tensor) -> torch.Tensor:
    """Sums of 16 rows, then their sum (a last pass of fewer rows than a multiple of 16 in one go)."""
    if m.shape[0] % 16:
        return m.sum(0, dtype=torch.float64)
    return m.view(-1, 16, BINS).sum(1, dtype=torch.float64).sum(0)


def _matrix_vector(m: torch.Tensor) -> torch.Tensor:
    return torch.mv(m.t().double(), torch.ones(m.shape[0], dtype=torch.float64, device=m.device))


REDUCTIONS: dict[str, Reduction] = {
    "fp64 column sum": lambda m: m.sum(0, dtype=torch.float64),
    "fp64 copy, sum": lambda m: m.double().sum(0),
    "16-row sums, sum": _two_stage,
    "transposed sum": lambda m: m.t().sum(1, dtype=torch.float64),
    "fp64 matrix-vector": _matrix_vector,
}


def sketch_in_passes(
    flat: torch.Tensor, offset: int, rows_per_pass: int, reduce: Reduction, long_table: torch.Tensor
) -> torch.Tensor:
    """The sketch of ``flat``'s whole rows, ``rows_per_pass`` rows a pass (signs from ``long_table``)."""
    sketch = torch.zeros(BINS, dtype=torch.float64, device=flat.device)
    whole = flat.numel() // BINS * BINS
    done = 0
    while done < whole:
        rows = min(rows_per_pass, (whole - done) // BINS)
        length = rows * BINS
        start = (offset + done) % SIGN_PERIOD
        sketch += reduce((flat[done : done + length] * long_table[start : start + length]).view(rows, BINS))
        done += length
    return sketch


def main() -> None:
    device = torch.device("cuda")
    period = sign_table(device)[:SIGN_PERIOD]
    longest = max(ROWS_PER_PASS) * BINS
    long_table = period.repeat(longest // SIGN_PERIOD + 2)[: SIGN_PERIOD + longest].contiguous()
    offset = sign_offset(1, 0, 0)
    print(f"device: {torch.cuda.get_device_name(device)}")
    print("| elements | rows a pass | column sum | µs | x the sketch as it is | max diff / max bin | repeats |")
    print("|---|---|---|---|---|---|---|")
    for n in SIZES:
        flat = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        for row in size_rows(flat, offset, long_table):
            print(row)


def size_rows(flat: torch.Tensor, offset: int, long_table: torch.Tensor) -> list[str]:
    """The table's rows for one bucket: the sketch as it is, then every variant against it."""
    n = flat.numel()
    as_it_is = median_seconds(lambda: gradient_sketch([[flat]], BINS, 1, 0), 15, flat.device)
    reference = gradient_sketch([[flat[: n // BINS * BINS]]], BINS, 1, 0)
    rows = [f"| {n:,} | as it is | | {as_it_is * 1e6:.0f} | 1.00 | | |"]
    for rows_per_pass in ROWS_PER_PASS:
        for name, reduce in REDUCTIONS.items():

            def run(rows_per_pass: int = rows_per_pass, reduce: Reduction = reduce) -> torch.Tensor:
                return sketch_in_passes(flat, offset, rows_per_pass, reduce, long_table)

            seconds = median_seconds(run, 7, flat.device)
            got = run()
            diff = float((got - reference).abs().max() / reference.abs().max())
            rows.append(
                f"| {n:,} | {rows_per_pass} | {name} | {seconds * 1e6:.0f} | {seconds / as_it_is:.2f} | {diff:.1e} "
                f"| {torch.equal(got, run())} |"
            )
    return rows


if __name__ == "__main__":
    main()
