"""Option clip's sketch on any device: the order its sums take there, and the torch way to take it without the kernel.

The order (:mod:`ds_lioncub.step.sketch`, :func:`ds_lioncub.comm.packing.sketch_and_squares`): each bin adds its
elements' signed fp32 values in fp64, one after another in element order, the pieces in the order given; a second
row of bins adds their squares the same way, and their pairwise fold is added to the last element. Every addition's
operands are fixed, so every implementation gives the same bits:

- a CPU: the CPU op's kernel, or its torch reference (one elementwise add per row of bins);
- a GPU since v2: the CUDA op's kernel (one launch per call, ``ops/csrc/cuda/lioncub_bandwidth_kernels.cu``) where
  the compiled path has it, else :func:`scan_sketch_and_squares`: whole rows of bins at once by ``torch.cumsum``
  along the rows, whose CUDA and CPU kernels add a column's rows one after another (ATen's ``scan_outer_dim`` and
  ``cpu_cum_base_kernel``; the GPU tests hold it to the definition), a few kernels per million elements instead of
  the reference's one per row;
- ``DS_LIONCUB_CUDA_KERNELS=v1`` keeps a GPU on the order it summed in before v2 (passes of column sums whose order
  is torch's; :func:`ds_lioncub.step.sketch.sketch_in_passes`): the benchmarks' "before", and the way to repeat a
  GPU run made before v2 bit for bit.

So a GPU's sketch now has a CPU's bits. Each rank sketches its own gradient and one all-reduce sums the sketches
before any rank uses them, so ranks agree whatever order each took; the order only decides which bits a run has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_lioncub.comm import packing
from ds_lioncub.comm.packing.torch_impl import TorchPacking, fold_pairwise
from ds_lioncub.kernels.compiled import SKETCH_DTYPES, CompiledPacking, kernel_generation

#: Elements of whole rows that :func:`scan_sketch_and_squares` adds with one cumsum (bounds its temporaries: about
#: 40 bytes per element).
SCAN_WINDOW = 1 << 20

_REFERENCE = TorchPacking()


def sums_in_element_order(device: torch.device) -> bool:
    """Whether the sketch of tensors on ``device`` sums in the element order above (the CPU's): always on a CPU, and
    elsewhere unless ``DS_LIONCUB_CUDA_KERNELS=v1`` asks for the order of the passes before v2."""
    return device.type == "cpu" or kernel_generation() != "v1"


def compiled_sketch_kernel(device: torch.device) -> bool:
    """Whether tensors on ``device`` (not a CPU) get the compiled op's sketch kernel: the compiled path is chosen there
    and its op has the kernel in the selected generation."""
    choice = packing.packing_path(device)
    inner = getattr(choice.ops, "ops", choice.ops)  # the self-checked wrapper's implementation
    return choice.path == "compiled" and isinstance(inner, CompiledPacking) and inner.has_kernel("sketch_and_squares")


def add_sketch_and_squares(
    pieces: Sequence[torch.Tensor],
    columns: Sequence[int],
    starts: Sequence[int],
    signs: torch.Tensor,
    period: int,
    out: torch.Tensor,
) -> None:
    """:func:`ds_lioncub.comm.packing.sketch_and_squares` on any device, in the element order: a CPU's path, the
    compiled kernel of another device, else :func:`scan_sketch_and_squares` (the same bits as the reference, faster
    on a GPU than its one add per row)."""
    if out.device.type == "cpu" or (
        all(piece.dtype in SKETCH_DTYPES for piece in pieces) and compiled_sketch_kernel(out.device)
    ):
        packing.sketch_and_squares(pieces, columns, starts, signs, period, out)
    else:
        scan_sketch_and_squares(pieces, columns, starts, signs, period, out)


def scan_sketch_and_squares(
    pieces: Sequence[torch.Tensor],
    columns: Sequence[int],
    starts: Sequence[int],
    signs: torch.Tensor,
    period: int,
    out: torch.Tensor,
) -> None:
    """The sketch and squares in the element order with torch: whole rows of bins by one ``cumsum`` each (a block of
    rows below the bins' running sums, summed down each column one row after another), a partial row by one
    elementwise add. A bin that starts at -0.0 (cumsum starts from +0.0, and -0.0 + -0.0 is -0.0), or a single bin
    (a one-column cumsum is a 1-d scan, which CUDA computes in a tree), takes the reference's path instead."""
    bins = out.numel() - 1
    initial = out[:bins]
    if bins < 2 or bool(((initial == 0) & torch.signbit(initial)).any()):
        _REFERENCE.sketch_and_squares(pieces, columns, starts, signs, period, out)
        return
    sums = initial.clone()
    squares = torch.zeros_like(sums)
    for piece, column, start in zip(pieces, columns, starts, strict=True):
        flat = piece.detach().reshape(-1)
        done = 0
        while done < flat.numel():
            bin_ = (column + done) % bins
            position = (start + done) % period
            left = flat.numel() - done
            # whole rows from a row start, their signs not across the period's end; else up to the row's end
            rows = min(left // bins, max(1, SCAN_WINDOW // bins), (period - position) // bins) if bin_ == 0 else 0
            length = rows * bins if rows else min(bins - bin_, left, period - position)
            values = flat[done : done + length].float()
            bit = position % 8
            window = signs[position // 8 : (position + length + 7) // 8]
            signed = (values * packing.unpack_signs(window, bit + length, torch.float32)[bit:]).double()
            square = values.double().square()
            if rows:
                sums = torch.cumsum(torch.cat([sums.view(1, bins), signed.view(rows, bins)]), 0)[-1].clone()
                squares = torch.cumsum(torch.cat([squares.view(1, bins), square.view(rows, bins)]), 0)[-1].clone()
            else:
                sums[bin_ : bin_ + length] += signed
                squares[bin_ : bin_ + length] += square
            done += length
    out[:bins].copy_(sums)
    out[bins:] += fold_pairwise(squares)


__all__ = [
    "SCAN_WINDOW",
    "add_sketch_and_squares",
    "compiled_sketch_kernel",
    "scan_sketch_and_squares",
    "sums_in_element_order",
]
