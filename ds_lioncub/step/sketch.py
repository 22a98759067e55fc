"""The sketch of a rank's gradients that option ``clip`` and the gradient noise scale share.

The sketch (a CountSketch with a structured hash): element ``i`` of tensor ``t`` is added to bin
``i mod K`` with the sign ``T[(o + i) mod P]``, where ``T`` is a fixed table of random signs of prime
length :data:`SIGN_PERIOD` and ``o`` (:func:`sign_offset`) mixes the step, ``t`` and the rank's shard, so
that the signs change from step to step and between tensors. Then ``E[|S|^2] = |g|^2`` for any gradient
``g``: two elements in one bin meet with independent signs (unless their table positions coincide, which
needs ``K * P`` elements between them inside a tensor), and the relative error of ``|S|^2`` is about
``sqrt(2 / K)`` when no bin holds a large share of the norm. A prime ``K`` (the default 4093) keeps the
columns of a matrix whose rows are a power of two long from all landing in one bin.

The order of the sums, on a CPU (:func:`sketch_and_square_norm`): each element's value in fp32 (bf16 and fp16
widen exactly) times its sign is exact; each bin starts at 0 and adds its elements' products in fp64 one
after another, in element order within a tensor (its pieces in order), tensor after tensor. The squared norm
sums the same way: a second row of ``K`` bins adds each element's square (exact in fp64) into bin
``i mod K``, and those ``K`` sums are folded pairwise (zeros pad them to a power of two ``2h``, then
``s[j] + s[j + h]`` for ``j < h``, halving ``h`` to 1; :func:`~ds_lioncub.comm.packing.torch_impl.fold_pairwise`).
Every addition's operands are thus fixed: the compiled kernel (``ops/csrc/cpu``, :func:`ds_lioncub.comm.packing.
sketch_and_squares`, which reads the gradient once, with a bit-packed copy of the table of signs) and its torch
reference (one elementwise add per row of ``K``) give the same bits, whatever the threads or the SIMD width, and
the first use of the kernel checks it against the reference. Since v2 a GPU sums in the same order, so a GPU's
sketch has a CPU's bits (:mod:`ds_lioncub.comm.packing.device_sketch`: the CUDA op's kernel, one launch per call,
else whole rows by ``torch.cumsum``); ``DS_LIONCUB_CUDA_KERNELS=v1`` keeps a GPU on the order before v2: passes of
:func:`chunk_for` elements, each a product with the fp32 table and a column sum of its rows into fp64 (whose order
is torch's, fixed for one device and shape), the squares by torch's ``sum`` (:func:`sketch_in_passes`).

Every rank sketches its own gradient; one all-reduce sums the sketches (a sketch is linear, so the sum is the sketch
of the summed gradient), and :mod:`ds_lioncub.step.clipping` turns the sum into option ``clip``'s factor and the
noise scale's update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_lioncub.comm import packing
from ds_lioncub.comm.packing.device_sketch import add_sketch_and_squares, sums_in_element_order

#: The length of the table of random signs (a prime, so that a table position repeats only after
#: ``sketch_bins * SIGN_PERIOD`` elements of one tensor).
SIGN_PERIOD = 1_048_573
#: Elements added per pass of the column sums (:func:`sketch_in_passes`) on any device but a GPU (bounds the
#: temporaries: one fp32 product of this many elements); a CPU's steps sketch with the kernel instead.
CHUNK = 1 << 20
#: Elements added per pass on a GPU: 1,024 rows of the default 4,093 bins. A pass's column sum of 256 rows keeps
#: too few of a GPU's threads busy; 1,024 rows take the sketch of 256 Mi elements from 3.2 to 0.65 Lion updates
#: on an H200 (benchmarks/RESULTS.md, "Option clip", its local cost), for a table of 21 MB and a 17 MB product.
CUDA_CHUNK = 1 << 22
#: The seed of the table of signs: part of the estimator, the same on every rank and in every version.
SIGN_SEED = 0x5EC7C11

_TABLES: dict[torch.device, torch.Tensor] = {}
_BIT_TABLES: dict[torch.device, torch.Tensor] = {}
_MASK64 = (1 << 64) - 1


def chunk_for(device: torch.device) -> int:
    """Elements per pass on ``device``: :data:`CUDA_CHUNK` on a GPU, else :data:`CHUNK`. Every rank of a job
    steps on one kind of device, so every rank sums its bins in the same order."""
    return CUDA_CHUNK if device.type == "cuda" else CHUNK


def sign_table(device: torch.device) -> torch.Tensor:
    """±1 in fp32, ``T[i mod SIGN_PERIOD]`` for ``i < SIGN_PERIOD + chunk_for(device)`` (so that any chunk-long
    window starting before SIGN_PERIOD is one slice), drawn once per device from :data:`SIGN_SEED` on the CPU."""
    table = _TABLES.get(device)
    if table is None:
        generator = torch.Generator().manual_seed(SIGN_SEED)
        period = torch.randint(0, 2, (SIGN_PERIOD,), generator=generator, dtype=torch.int8).float().mul_(2).sub_(1)
        chunk = chunk_for(device)
        table = torch.cat([period, period.repeat(chunk // SIGN_PERIOD + 1)])
        table = table[: SIGN_PERIOD + chunk].to(device, copy=True)  # not a view of the longer cat
        _TABLES[device] = table
    return table


def sign_bits_table(device: torch.device) -> torch.Tensor:
    """The signs of :func:`sign_table`'s period as bits (uint8, the packing's sign layout: bit ``i`` is 1 where
    ``T[i]`` is +1), ``SIGN_PERIOD + 64`` of them (the last 64 repeat the first: the kernel reads 64 bits at a time
    from any position before the period's end): what the CPU kernel reads, 1/32 of the fp32 table's bytes. Made
    once per device from :func:`sign_table`, so both give the same signs."""
    table = _BIT_TABLES.get(device)
    if table is None:
        period = sign_table(torch.device("cpu"))[:SIGN_PERIOD]
        signs = torch.cat([period, period[:64]])
        table = packing.pack_signs(signs, zero_is_positive=False).to(device, copy=True)
        _BIT_TABLES[device] = table
    return table


def sign_offset(step: int, tensor: int, shard: int) -> int:
    """Where tensor ``tensor``'s element 0 reads the sign table at step ``step`` on shard ``shard``: a 64-bit
    multiply-xorshift mix of the three (any fixed mix would do; it must only spread nearby inputs apart)."""
    x = (step * 0x9E3779B97F4A7C15 + tensor * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % SIGN_PERIOD


def _walk(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, offsets: Sequence[int]
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Every piece of ``tensors``, its first element's bin and its first element's position in the table of signs;
    tensor ``t``'s element 0 is at bin 0 and at ``offsets[t]``."""
    pieces: list[torch.Tensor] = []
    columns: list[int] = []
    starts: list[int] = []
    for offset, tensor_pieces in zip(offsets, tensors, strict=True):
        position = 0
        for piece in tensor_pieces:
            pieces.append(piece)
            columns.append(position % bins)
            starts.append((offset + position) % SIGN_PERIOD)
            position += piece.numel()
    return pieces, columns, starts


def _add_in_element_order(out: torch.Tensor, tensors: Sequence[Sequence[torch.Tensor]], offsets: Sequence[int]) -> None:
    """The sketch and squares of ``tensors`` added to ``out`` (fp64, bins + 1), in the module's order (a CPU's, and
    since v2 a GPU's)."""
    pieces, columns, starts = _walk(tensors, out.numel() - 1, offsets)
    add_sketch_and_squares(pieces, columns, starts, sign_bits_table(out.device), SIGN_PERIOD, out)


def add_to_sketch(sketch: torch.Tensor, pieces: Sequence[torch.Tensor], offset: int) -> None:
    """Add the sketch of one flat tensor, given as consecutive ``pieces``, to ``sketch`` (fp64, K bins) in place.

    Element ``i`` of the concatenation goes to bin ``i mod K`` with sign ``T[(offset + i) mod P]``; each
    product is exact in fp32 (a sign), and each bin's sum is taken in fp64: continuing each bin's sum one element
    after another (the module's order), or with ``DS_LIONCUB_CUDA_KERNELS=v1`` on a GPU by passes of column sums.
    """
    bins = sketch.numel()
    if sums_in_element_order(sketch.device):
        out = torch.cat([sketch, sketch.new_zeros(1)])
        _add_in_element_order(out, [pieces], [offset])
        sketch.copy_(out[:bins])
    else:
        _add_in_passes(sketch, pieces, offset)


def _add_in_passes(sketch: torch.Tensor, pieces: Sequence[torch.Tensor], offset: int) -> None:
    """:func:`add_to_sketch` by passes of :func:`chunk_for` elements: a product with the fp32 table of signs, then
    a column sum of the pass's rows into fp64 (a partial row added alone)."""
    bins = sketch.numel()
    table = sign_table(sketch.device)
    chunk = chunk_for(sketch.device)
    position = 0
    for piece in pieces:
        flat = piece.detach().reshape(-1)
        done = 0
        while done < flat.numel():
            column = position % bins
            left = flat.numel() - done
            if column or left < bins:  # up to the next row start, or the last partial row
                length = min(bins - column, left)
                rows = 1
            else:
                rows = min(max(1, chunk // bins), left // bins)
                length = rows * bins
            start = (offset + position) % SIGN_PERIOD
            values = flat[done : done + length].float() * table[start : start + length]
            if rows == 1 and length < bins:
                sketch[column : column + length] += values.double()
            else:
                sketch += values.view(rows, bins).sum(0, dtype=torch.float64)
            done += length
            position += length


def gradient_sketch(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """The fp64 sketch (``bins`` bins) of a rank's gradients: ``tensors[t]`` holds the pieces of flat tensor
    ``first_tensor + t`` (one piece for a parameter's gradient, several for a ZeRO partition's)."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    if sums_in_element_order(device):
        return sketch_and_square_norm(tensors, bins, step, shard, first_tensor)[:bins]
    return sketch_in_passes(tensors, bins, step, shard, first_tensor)


def sketch_in_passes(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """:func:`gradient_sketch` as a device other than the CPU (a GPU) sums it: passes of :func:`chunk_for` elements,
    each a product with the fp32 table of signs and a column sum of its rows into fp64, on any device."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    sketch = torch.zeros(bins, dtype=torch.float64, device=device)
    for t, pieces in enumerate(tensors):
        _add_in_passes(sketch, pieces, sign_offset(step, first_tensor + t, shard))
    return sketch


def sketch_and_square_norm(
    tensors: Sequence[Sequence[torch.Tensor]], bins: int, step: int, shard: int, first_tensor: int = 0
) -> torch.Tensor:
    """``bins + 1`` fp64 numbers: :func:`gradient_sketch`'s bins, then the rank's squared norm, the sum of the squares
    of every element of ``tensors`` (one all-reduce then sums both over the ranks: the sketch of the summed
    gradient, and the ranks' own squared norms, which the gradient noise scale needs).

    One pass of the compiled kernel (or its torch equivalent) reads each element once for both, in the order the
    module's docstring defines; with ``DS_LIONCUB_CUDA_KERNELS=v1`` a GPU takes the sketch's passes, then the
    squares' sums."""
    device = next((piece.device for pieces in tensors for piece in pieces), torch.device("cpu"))
    if sums_in_element_order(device):
        out = torch.zeros(bins + 1, dtype=torch.float64, device=device)
        _add_in_element_order(out, tensors, [sign_offset(step, first_tensor + t, shard) for t in range(len(tensors))])
        return out
    sketch = sketch_in_passes(tensors, bins, step, shard, first_tensor)
    squares = torch.zeros(1, dtype=torch.float64, device=sketch.device)
    for pieces in tensors:
        for piece in pieces:
            squares += piece.detach().reshape(-1).double().square().sum()
    return torch.cat([sketch, squares])


__all__ = [
    "CHUNK",
    "CUDA_CHUNK",
    "SIGN_PERIOD",
    "SIGN_SEED",
    "add_to_sketch",
    "chunk_for",
    "gradient_sketch",
    "sign_bits_table",
    "sign_offset",
    "sign_table",
    "sketch_and_square_norm",
    "sketch_in_passes",
]
