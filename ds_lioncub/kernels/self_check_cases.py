"""The cases of the packing self-check (:mod:`.self_check`): small deterministic inputs for every operation.

:func:`cases_of` gives the cases of one operation on one dtype: each is run on the implementation under check
and on the torch reference, and the two results must be the same bytes. What they cover, operation by
operation, is listed in :mod:`.self_check`'s docstring. Inputs are made on the CPU from :data:`SEED` and moved
to the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import torch

from ds_lioncub.comm.packing.layout import (
    FIELD_WIDTHS,
    L1_FIELD_WIDTHS,
    MomentumPiece,
    PackingOps,
    ParamPiece,
    packed_length,
)

SIZES = (0, 13, 1029)  # 1029 signs: two full 64-byte vote blocks of the compiled vote and a ragged byte
VOTERS = (1, 2, 3, 4, 8, 16, 33, 64)  # bit planes 1 to 7 of the compiled vote
SUMMED_ROWS = (1, 2, 3, 17)
SEED = 20240521


class Fresh(NamedTuple):
    """An argument made anew for each run of a case (an ``out`` tensor the implementation writes)."""

    make: Callable[[], torch.Tensor]


class StepCase(NamedTuple):
    """A fused step operation: ``run_on(ops)`` makes fresh tensors, runs it, and returns every result as bytes."""

    operation: str
    description: str
    run_on: Callable[[PackingOps], torch.Tensor]

    def run(self, ops: PackingOps) -> torch.Tensor:
        return self.run_on(ops)


class Case(NamedTuple):
    """``operation(*args)``, to be run on the implementation under check and on the reference."""

    operation: str
    description: str
    args: tuple[Any, ...]

    def run(self, ops: PackingOps) -> torch.Tensor:
        args = tuple(arg.make() if isinstance(arg, Fresh) else arg for arg in self.args)
        result: torch.Tensor = getattr(ops, self.operation)(*args)
        return result


# ====================================================================== the inputs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(SEED + seed)


def _elements(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values whose signs get packed: zeros of both signs, NaN, infinities and subnormals among floats."""
    g = _generator(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device="cpu").bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-3 if dtype.is_signed else 0, 4, (n,), generator=g, device="cpu").to(dtype)
    x = torch.randn(n, generator=g, device="cpu")
    x[torch.rand(n, generator=g, device="cpu") < 0.25] = 0.0
    specials = (-0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, 0.0, -float("nan"))
    for i, value in enumerate(specials[: n // 4]):
        x[3 * i + 1] = value
    return x.to(dtype)


def _fields(n: int, bits: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Fields below 2**bits, held in ``dtype`` (which must hold them exactly)."""
    high = 2 if dtype == torch.bool else 1 << bits
    if dtype.is_signed and not dtype.is_floating_point and dtype.itemsize == 1:
        high = min(high, 128)
    values = torch.randint(0, high, (n,), generator=_generator(seed), device="cpu")
    return values.bool() if dtype == torch.bool else values.to(dtype)


def _bytes(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random message bytes, as ``dtype`` (the same bits for a 1-byte integer dtype)."""
    raw = torch.randint(0, 256, (n,), generator=_generator(seed), device="cpu").to(torch.uint8)
    if dtype == torch.uint8:
        return raw
    if dtype.itemsize == 1 and not dtype.is_floating_point and dtype != torch.bool:
        return raw.view(dtype)
    return raw.to(dtype)


def cases_of(operation: str, dtype: torch.dtype, device: torch.device) -> Iterator[Case | StepCase]:
    builders: dict[str, Callable[[torch.dtype, torch.device], Iterator[Case | StepCase]]] = {
        "pack_fields": _pack_fields_cases,
        "unpack_fields": _unpack_fields_cases,
        "pack_signs": _pack_signs_cases,
        "unpack_signs": _unpack_signs_cases,
        "sum_fields_per_position": _sum_fields_cases,
        "vote_packed_signs": _vote_cases,
        "pack_l1_fields": _pack_l1_cases,
        "pack_l1_fields_of_means": _pack_l1_means_cases,
        "vote_field_sums": _field_vote_cases,
        "lion_direction_pack_signs": _direction_cases,
        "apply_packed_signs": _apply_cases,
        "sketch_and_squares": _sketch_cases,
    }
    return builders[operation](dtype, device)


def _pack_signs_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for n in SIZES:
        x = _elements(n, dtype, seed=n).to(device)
        for bits in FIELD_WIDTHS:
            for zero_is_positive in (True, False):
                for pad in (0, 3):
                    nbytes = packed_length(n, bits) + pad
                    yield Case(
                        "pack_signs",
                        f"{n} elements, {bits}-bit fields, zero_is_positive={zero_is_positive}, nbytes={nbytes}",
                        (x, zero_is_positive, bits, nbytes),
                    )
    strided = _elements(2 * SIZES[-1], dtype, seed=1).to(device)[::2]
    yield Case(
        "pack_signs",
        f"a strided view of {strided.numel()} elements",
        (strided, False, 1, packed_length(strided.numel())),
    )


def _unpack_signs_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for n in SIZES:
        packed = _bytes(packed_length(n) + 2, torch.uint8, seed=n).to(device)  # bits past numel are noise
        yield Case("unpack_signs", f"{n} signs", (packed, n, dtype, None))
        out = Fresh(partial(torch.full, (n,), 7, dtype=dtype, device=device))
        yield Case("unpack_signs", f"{n} signs into out", (packed, n, dtype, out))


def _pack_l1_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    scales = torch.tensor([0.25, 1.5, 0.0, 1.7], dtype=torch.float32, device="cpu")  # 0: the whole segment is q = 0
    for bits in L1_FIELD_WIDTHS:
        top = ((1 << bits) - 1) // 2
        for levels in sorted({1, max(1, top // 2), top}):
            # c * 0.25 lands exactly on k + 1/2 for these: round half to even decides
            halves = 4 * (torch.arange(-levels - 2, levels + 2, dtype=torch.float32, device="cpu") + 0.5)
            for n in (1029,):
                noise = _elements(n, torch.float32, seed=n + levels).nan_to_num(0.0, math.inf, -math.inf) * 3
                c = torch.cat([halves, noise]).to(dtype).to(device)
                third = c.numel() // 3
                sizes = [third, 0, third, c.numel() - 2 * third]  # an empty segment, too
                for pad in (0, 3):
                    nbytes = packed_length(c.numel(), bits) + pad
                    yield Case(
                        "pack_l1_fields",
                        f"{c.numel()} elements, {bits}-bit fields, {levels} levels, nbytes={nbytes}",
                        (c, scales, sizes, levels, bits, nbytes),
                    )


# Means of the L1 scale: ordinary, 0 (the segment's q are 0), NaN and negative (not > 0: scale 0), a subnormal
# whose clip * mu rounds to 0 in fp32 (1 / 0: an infinite scale), and one whose product is subnormal.
L1_MEANS = (0.7, 0.0, 2.5e-3, math.nan, -1.0, 1e-45, 3e-39, 1.3)
L1_CLIPS = (2.0, 0.7)


def _pack_l1_means_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for bits in L1_FIELD_WIDTHS:
        top = ((1 << bits) - 1) // 2
        for levels in sorted({1, top}):
            noise = _elements(1029, torch.float32, seed=levels + bits).nan_to_num(0.0, math.inf, -math.inf) * 3
            c = torch.cat([4 * (torch.arange(-levels - 2, levels + 2, dtype=torch.float32) + 0.5), noise])
            c = c.to(dtype).to(device)
            sizes = [5, 0, 300, 1, 64, 17, 9]
            sizes.append(c.numel() - sum(sizes))
            means = torch.tensor(L1_MEANS, dtype=torch.float32, device=device)
            for clip in L1_CLIPS:
                for pad in (0, 3):
                    nbytes = packed_length(c.numel(), bits) + pad
                    yield Case(
                        "pack_l1_fields_of_means",
                        f"{c.numel()} elements, {bits}-bit fields, {levels} levels, clip {clip}, nbytes={nbytes}",
                        (c, means, sizes, levels, clip, bits, nbytes),
                    )


def _field_vote_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for bits in FIELD_WIDTHS:
        top = (1 << bits) - 1
        for p in SUMMED_ROWS:
            for n, extra in ((1029, 2), (1024, 0)):
                row_bytes = packed_length(n, bits) + extra  # 0 extra bytes at 1024: rows a multiple of 16 bytes
                rows = _bytes(p * row_bytes, dtype, seed=7000 + 100 * p + 10 * n + bits).view(p, row_bytes)
                for threshold in sorted({-1, 1, (p * top + 1) // 2, p * top, p * top + 1}):
                    yield Case(
                        "vote_field_sums",
                        f"{p} rows of {n} {bits}-bit fields, threshold {threshold}",
                        (rows.to(device), bits, n, threshold),
                    )
        rows = _bytes(3 * 70, dtype, seed=50 + bits).view(3, 70).to(device)[:, 1:]
        yield Case(
            "vote_field_sums",
            f"3 non-contiguous rows of {bits}-bit fields",
            (rows, bits, 69 * 8 // bits, 3 * top // 2),
        )


def _pack_fields_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for n in SIZES:
        for bits in FIELD_WIDTHS:
            values = _fields(n, bits, dtype, seed=10 * n + bits).to(device)
            for pad in (0, 3):
                nbytes = packed_length(n, bits) + pad
                yield Case(
                    "pack_fields",
                    f"{n} fields of {bits} bits, nbytes={nbytes}",
                    (values, bits, nbytes),
                )


def _unpack_fields_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for n in SIZES:
        for bits in FIELD_WIDTHS:
            packed = _bytes(packed_length(n, bits) + 3, dtype, seed=100 * n + bits).to(device)
            yield Case(
                "unpack_fields",
                f"{n} fields of {bits} bits",
                (packed, bits, n),
            )


def _sum_fields_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for bits in FIELD_WIDTHS:
        for p in SUMMED_ROWS:
            for n in (13, 1029):
                row_bytes = packed_length(n, bits) + 2  # bytes past the fields must not count
                rows = _bytes(p * row_bytes, dtype, seed=1000 * p + 10 * n + bits).view(p, row_bytes).to(device)
                yield Case(
                    "sum_fields_per_position",
                    f"{p} rows of {n} {bits}-bit fields",
                    (rows, bits, n),
                )
        rows = _bytes(3 * 40, dtype, seed=bits).view(3, 40).to(device)[:, 1:]
        yield Case(
            "sum_fields_per_position",
            f"3 non-contiguous rows of {bits}-bit fields",
            (rows, bits, 39 * 8 // bits),
        )


def _vote_cases(dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    for p in VOTERS:
        for n in (1029,):
            row_bytes = packed_length(n) + 1  # the bits past numel are noise and must not vote
            rows = _bytes(p * row_bytes, dtype, seed=100 * p + n).view(p, row_bytes).to(device)
            for zero_is_positive in (True, False):
                yield Case(
                    "vote_packed_signs",
                    f"{p} voters, {n} signs, zero_is_positive={zero_is_positive}",
                    (rows, n, zero_is_positive),
                )
    rows = _bytes(4 * 140, dtype, seed=4).view(4, 140).to(device)[:, 1:]
    yield Case(
        "vote_packed_signs",
        "4 non-contiguous rows, 1029 signs",
        (rows, 1029, False),
    )


# ---------------------------------------------------------------------- the fused step

STEP_PIECE_SIZES = (5, 1, 13, 1029, 3, 64)  # pieces start mid-byte, end mid-byte, and span whole groups
STEP_BETAS = ((0.9, 0.99), (0.95, 0.98), (0.0, 0.5), (0.5, 0.999), (0.99, 0.9), (0.9, 0.99))
STEP_RATES = ((1e-4, 0.0), (3e-4, 0.1), (1.0, 0.5), (0.1, 1e-9), (2.5e-3, 0.01), (1e-6, 0.0))


def _nan_as_nan_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` with every NaN replaced by one NaN: NaN positions compare, payloads do not."""
    return torch.where(x.isnan(), torch.full_like(x, math.nan), x).view(torch.uint8)


def _run_direction(
    momenta: torch.Tensor, grads: torch.Tensor, zero_is_positive: bool, bits: int, nbytes: int, ops: PackingOps
) -> torch.Tensor:
    updated = momenta.clone()
    pieces = [
        MomentumPiece(m, g, beta1, beta2)
        for m, g, (beta1, beta2) in zip(
            updated.split(STEP_PIECE_SIZES), grads.split(STEP_PIECE_SIZES), STEP_BETAS, strict=True
        )
    ]
    packed = ops.lion_direction_pack_signs(pieces, zero_is_positive, bits, nbytes)
    return torch.cat([packed, _nan_as_nan_bytes(updated)])


def _run_apply(packed: torch.Tensor, params: torch.Tensor, ops: PackingOps) -> torch.Tensor:
    updated = params.clone()
    pieces = [
        ParamPiece(p, lr, weight_decay)
        for p, (lr, weight_decay) in zip(updated.split(STEP_PIECE_SIZES), STEP_RATES, strict=True)
    ]
    ops.apply_packed_signs(packed, pieces)
    return _nan_as_nan_bytes(updated)


def _direction_cases(dtype: torch.dtype, device: torch.device) -> Iterator[StepCase]:
    n = sum(STEP_PIECE_SIZES)
    momenta = _elements(n, dtype, seed=7).to(device)
    grads = (_elements(n, torch.float32, seed=8) * 3).to(dtype).to(device)
    for bits in FIELD_WIDTHS:
        for zero_is_positive in (True, False):
            for pad in (0, 3):
                nbytes = packed_length(n, bits) + pad
                yield StepCase(
                    "lion_direction_pack_signs",
                    f"pieces of {STEP_PIECE_SIZES} elements, {bits}-bit fields, "
                    f"zero_is_positive={zero_is_positive}, nbytes={nbytes}",
                    partial(_run_direction, momenta, grads, zero_is_positive, bits, nbytes),
                )


def _apply_cases(dtype: torch.dtype, device: torch.device) -> Iterator[StepCase]:
    n = sum(STEP_PIECE_SIZES)
    params = _elements(n, dtype, seed=9).to(device)
    packed = _bytes(packed_length(n) + 2, torch.uint8, seed=10).to(device)  # bits past the pieces are noise
    yield StepCase(
        "apply_packed_signs",
        f"pieces of {STEP_PIECE_SIZES} elements, (lr, weight decay) {STEP_RATES}",
        partial(_run_apply, packed, params),
    )


# ---------------------------------------------------------------------- option clip's sketch

SKETCH_TENSORS = ((5, 1, 13), (1029, 3, 64))  # two tensors in pieces: the second starts again at bin 0
SKETCH_LAYOUTS = ((13, 61), (100, 1031), (4093, 61))  # (bins, bits of the table of signs before it repeats)


def sketch_signs(period: int, seed: int) -> torch.Tensor:
    """Random sign bits for a table of ``period``, packed, followed by a copy of its first 64 (what the op reads)."""
    bits = torch.randint(0, 2, (period,), generator=_generator(seed), device="cpu")
    extended = bits[torch.arange(period + 64) % period]
    padded = torch.cat([extended, extended.new_zeros(-extended.numel() % 8)]).view(-1, 8)
    return (padded << torch.arange(8)).sum(1).to(torch.uint8)


def _run_sketch(
    pieces: list[torch.Tensor],
    columns: list[int],
    starts: list[int],
    signs: torch.Tensor,
    period: int,
    initial: torch.Tensor,
    ops: PackingOps,
) -> torch.Tensor:
    out = initial.clone()
    ops.sketch_and_squares(pieces, columns, starts, signs, period, out)
    return _nan_as_nan_bytes(out)


def _sketch_cases(dtype: torch.dtype, device: torch.device) -> Iterator[StepCase]:
    for bins, period in SKETCH_LAYOUTS:
        signs = sketch_signs(period, seed=period).to(device)
        initial = torch.randn(bins + 1, generator=_generator(bins), dtype=torch.float64).to(device)
        for specials in (True, False):
            pieces: list[torch.Tensor] = []
            columns: list[int] = []
            starts: list[int] = []
            for t, sizes in enumerate(SKETCH_TENSORS):
                elements = _elements(sum(sizes), torch.float32, seed=20 + t) * 3
                if not specials:
                    elements = elements.nan_to_num(0.0, 0.0, 0.0)
                offset = period - 1 - 7 * t  # near the end of the table: pieces read across its period
                position = 0
                for piece in elements.to(dtype).to(device).split(sizes):
                    pieces.append(piece)
                    columns.append(position % bins)
                    starts.append((offset + position) % period)
                    position += piece.numel()
            yield StepCase(
                "sketch_and_squares",
                f"tensors in pieces of {SKETCH_TENSORS} elements, {bins} bins, signs of period {period}, "
                f"{'with' if specials else 'without'} NaN and infinities",
                partial(_run_sketch, pieces, columns, starts, signs, period, initial),
            )


__all__ = ["SEED", "SKETCH_LAYOUTS", "Case", "Fresh", "StepCase", "cases_of", "sketch_signs"]
