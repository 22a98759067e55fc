"""Option clip's sketch as a packing operation (``packing.sketch_and_squares``) against a plain Python loop.

The definition (ds_lioncub/step/clipping.py, its docstring): element ``i`` of piece ``p`` goes to bin
``(columns[p] + i) mod K`` with sign bit ``(starts[p] + i) mod period`` of the table (1 = +1, least significant
bit first); each bin adds, one element after another in fp64, the fp32 value times its sign, the pieces in
order, starting from what ``out`` holds; K more bins add the squares the same way, and ``out[K]`` adds their
pairwise fold (zeros up to a power of two ``2h``, then ``s[j] + s[j + h]``, halving ``h``). The reference below
is that sentence in Python floats (IEEE doubles), one element at a time, sharing no code with the library.
Each test runs on every implementation this process can run (torch always, the compiled CPU op when it
builds), so both are held to the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ds_lioncub.comm import packing
from ds_lioncub.comm.packing import dispatch
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.kernels.self_check import SelfCheckedPacking
from tests.support.clip_reference import plain_pairwise_fold
from tests.support.implementations import Implementation

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (bins, period of the table): one bin, bins that do not divide the rows, a period shorter than a row
LAYOUTS = ((1, 7), (5, 61), (13, 61), (100, 1031), (61, 50))
# Two tensors, the first in pieces that start and end mid-row
TENSORS = ((5, 1, 13, 300, 2), (77, 1))
LARGE = (1 << 18) + 4093 * 3 + 17  # past the size from which the CPU kernel splits its bins between threads


def table(period: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Random signs for a table of ``period`` (as 0/1) and their packed form with the first 64 bits repeated."""
    bits = np.random.default_rng(seed).integers(0, 2, period)
    extended = bits[np.arange(period + 64) % period].astype(np.uint8)
    return bits.tolist(), torch.from_numpy(np.packbits(extended, bitorder="little"))


def reference(
    pieces: list[torch.Tensor], columns: list[int], starts: list[int], bits: list[int], initial: torch.Tensor
) -> torch.Tensor:
    bins = initial.numel() - 1
    sums = initial[:bins].tolist()
    squares = [0.0] * bins
    for piece, column, start in zip(pieces, columns, starts, strict=True):
        for i, value in enumerate(piece.float().tolist()):
            signed = value if bits[(start + i) % len(bits)] else -value
            sums[(column + i) % bins] += signed
            squares[(column + i) % bins] += value * value
    return torch.tensor([*sums, float(initial[bins]) + plain_pairwise_fold(squares)], dtype=torch.float64)


def walk(tensors: list[list[torch.Tensor]], bins: int, offsets: list[int], period: int) -> tuple[list[int], list[int]]:
    """Each piece's first bin and table position: a tensor starts at bin 0 and at its offset."""
    columns, starts = [], []
    for offset, pieces in zip(offsets, tensors, strict=True):
        position = 0
        for piece in pieces:
            columns.append(position % bins)
            starts.append((offset + position) % period)
            position += piece.numel()
    return columns, starts


def elements(n: int, dtype: torch.dtype, seed: int, specials: bool = False) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    x[::7] = 0.0
    x[3::11] = -0.0
    if specials:
        x[2] = math.nan
        x[min(4, n - 1)] = math.inf
    return x.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, every NaN as any NaN (IEEE 754 leaves a NaN's sign and payload to the hardware)."""
    nan = got.isnan()
    return torch.equal(nan, want.isnan()) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize(("bins", "period"), LAYOUTS)
def test_the_sketch_is_the_plain_loop(impl: Implementation, dtype: torch.dtype, bins: int, period: int) -> None:
    bits, signs = table(period, seed=period)
    flat = [elements(sum(sizes), dtype, seed=t) for t, sizes in enumerate(TENSORS)]
    tensors = [list(x.split(sizes)) for x, sizes in zip(flat, TENSORS, strict=True)]
    # offsets near the end of the table: pieces and rows read across the period
    columns, starts = walk(tensors, bins, [period - 3, period // 2], period)
    pieces = [piece for pieces in tensors for piece in pieces]
    initial = torch.randn(bins + 1, generator=torch.Generator().manual_seed(bins), dtype=torch.float64)
    out = impl.put(initial.clone())
    packing.sketch_and_squares([impl.put(p) for p in pieces], columns, starts, impl.put(signs), period, out)
    assert torch.equal(out.cpu(), reference(pieces, columns, starts, bits, initial))


def test_nan_and_infinities_reach_their_bins(impl: Implementation) -> None:
    bits, signs = table(61, seed=1)
    pieces = [elements(200, torch.float32, seed=2, specials=True)]
    initial = torch.zeros(14, dtype=torch.float64)
    out = impl.put(initial.clone())
    packing.sketch_and_squares([impl.put(pieces[0])], [0], [60], impl.put(signs), 61, out)
    want = reference(pieces, [0], [60], bits, initial)
    assert want[:13].isnan().any() and want[:13].isfinite().any() and same(out.cpu(), want)


def test_a_large_tensor_split_between_threads_is_the_plain_loop(impl: Implementation) -> None:
    bits, signs = table(1031, seed=3)
    x = elements(LARGE, torch.float32, seed=4)
    pieces = [x[:4000], x[4000:]]
    columns, starts = walk([pieces], 4093, [1000], 1031)
    initial = torch.zeros(4094, dtype=torch.float64)
    out = impl.put(initial.clone())
    packing.sketch_and_squares([impl.put(p) for p in pieces], columns, starts, impl.put(signs), 1031, out)
    assert torch.equal(out.cpu(), reference(pieces, columns, starts, bits, initial))


def test_bad_arguments_are_refused() -> None:
    _, signs = table(61, seed=5)
    x, out = torch.zeros(9), torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 tensor of bins"):
        packing.sketch_and_squares([x], [0], [0], signs, 61, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="period \\+ 64 = 125 bits"):
        packing.sketch_and_squares([x], [0], [0], signs[:-1], 61, out)
    with pytest.raises(ValueError, match="one column and one start per piece"):
        packing.sketch_and_squares([x], [0, 1], [0], signs, 61, out)
    with pytest.raises(ValueError, match="a column outside \\[0, 7\\)"):
        packing.sketch_and_squares([x], [7], [0], signs, 61, out)
    with pytest.raises(ValueError, match="a column outside"):
        packing.sketch_and_squares([x], [0], [61], signs, 61, out)
    with pytest.raises(ValueError, match="floating point"):
        packing.sketch_and_squares([x.int()], [0], [0], signs, 61, out)


class BinFlipped:
    """The real op, but the sketch flips the lowest bit of its first bin."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.__name__ = "a wrong stand-in"

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.real, name)
        if name != "sketch_and_squares":
            return function

        def call(*args: Any) -> None:
            function(*args)
            args[-1].view(torch.int64)[0] ^= 1

        return call


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_a_wrong_sketch_kernel_is_refused_on_its_first_use(
    cpu_op: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    wrong = BinFlipped(cpu_op)
    monkeypatch.setattr(dispatch, "_load_compiled", lambda device_type: (wrong, "a stand-in around the CPU op"))
    packing._chosen.clear()
    packing.set_packing_path("compiled")
    try:
        assert isinstance(packing.packing_path("cpu").ops, SelfCheckedPacking)
        _, signs = table(61, seed=6)
        out = torch.ones(8, dtype=torch.float64)
        with pytest.raises(LionCubSetupError, match=f"sketch_and_squares on {str(dtype).removeprefix('torch.')}"):
            packing.sketch_and_squares([elements(30, dtype, seed=7)], [0], [0], signs, 61, out)
        assert torch.equal(out, torch.ones(8, dtype=torch.float64)), "a refused call changed out"
    finally:
        packing.set_packing_path(None)
        packing._chosen.clear()
