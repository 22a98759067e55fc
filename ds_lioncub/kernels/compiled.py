"""The compiled implementation: the op-builder kernels of ``ops/csrc`` (C++/OpenMP/AVX2 on CPU, CUDA on GPU).

The kernels write into preallocated outputs and read contiguous inputs of a few dtypes, listed once
below. Any other dtype goes to the pure torch implementation, which gives the same bytes: an exotic
dtype costs speed, never a failure. The CPU and CUDA ops have the same functions, so one class serves
both; :mod:`ds_lioncub.comm.packing.dispatch` loads the op for the device and builds one :class:`CompiledPacking`
around it.

The fused step kernels (``lion_direction_pack_signs``, ``apply_packed_signs``) take a whole bucket and
reproduce the torch composition bit for bit where torch's own rounding does not depend on where an
element falls in its loops (measured, and held to it by the tests and the self-check):

- fp32 momentum and gradient: direction, momentum update and sign pack in one pass;
- bf16/fp16 momentum with a gradient of the same dtype: direction and sign pack in one pass, then
  torch's own ``update_momentum`` (its 16-bit ``add_`` with alpha rounds one way in its vectorised
  body and another in its scalar remainder, and which elements fall where depends on torch's
  thread split and CPU capability, so no kernel could match it everywhere);
- fp32, bf16 or fp16 parameters: unpack and update in one pass (all of it computes in fp32).

Any other bucket (a bf16 gradient beside an fp32 momentum, a momentum view the kernel cannot write
through) runs the torch composition instead, decided by the dtypes alone, so the same bucket always
takes the same path; the two give the same bits, a choice of speed only. An op built before these
kernels existed (a stale prebuilt module) also leaves them to torch.

Option clip's sketch (``sketch_and_squares``) reads fp32, bf16 or fp16 pieces once, with a bit-packed table of
signs, and adds the signed values and their squares into fp64 bins, each bin one element after another in a
fixed order (:mod:`ds_lioncub.step.clipping`), which the torch reference repeats with one elementwise add per
row: the same bits, threads or not (each thread owns a range of bins). The CUDA op has it too, in one launch
(v2), with the same order.

The CUDA op's second generation of kernels (v2, ``ops/csrc/cuda/lioncub_bandwidth_kernels.cu``) runs under the
usual names; ``DS_LIONCUB_CUDA_KERNELS=v1`` takes the first generation instead (``pack_signs_v1``,
``unpack_signs_v1``, ``vote_packed_signs_v1``) and leaves the operations v2 added (``vote_field_sums``,
``pack_l1_fields_of_means``, the CUDA sketch) to their compositions, as before v2: the benchmarks' "before".
Both generations give the same bytes, and each is held to the torch reference by the self-check.
Two operations have no kernel on the CPU op and compose the CPU kernels they are made of, so a CPU step runs the
same kernels as before they existed: ``vote_field_sums`` (unpack or sum the fields, compare, pack) and
``pack_l1_fields_of_means`` (the scales in torch, then the quantize-and-pack kernel).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ds_lioncub.comm.packing.layout import MomentumPiece, PackingOps, ParamPiece, packed_length
from ds_lioncub.comm.packing.torch_impl import at_least
from ds_lioncub.lion import update_momentum

#: ``v1`` selects the CUDA op's first generation of kernels (before v2) for the benchmarks' "before"; anything
#: else (the default) the second. Read when the compiled path is set up for a device type.
KERNELS_ENV = "DS_LIONCUB_CUDA_KERNELS"
#: The CUDA op's kernels whose first generation is kept under ``<name>_v1``.
FIRST_GENERATION = ("pack_signs", "unpack_signs", "vote_packed_signs")
#: The CUDA op's kernels that v2 added: with ``DS_LIONCUB_CUDA_KERNELS=v1`` their operations compose as before.
SECOND_GENERATION_ONLY = ("vote_field_sums", "quantize_l1_means_pack", "sketch_and_squares")


def kernel_generation() -> str:
    """``"v1"`` where ``DS_LIONCUB_CUDA_KERNELS=v1`` asks for the CUDA op's first generation of kernels, else "v2"."""
    return "v1" if os.environ.get(KERNELS_ENV, "").strip().lower() == "v1" else "v2"


# The dtypes the kernels accept.
SIGN_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool)  # pack_signs
SIGN_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # unpack_signs
FIELD_INPUT_DTYPES = (torch.uint8, torch.bool, torch.int32)  # pack_fields
L1_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # quantize_l1_pack
MESSAGE_DTYPE = torch.uint8  # what unpack_fields, unpack_signs, sum_fields and vote_packed_signs read
# The fused step kernels: momentum with a gradient of the same dtype, and parameters, of these dtypes.
FUSED_STEP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Option clip's sketch: pieces of these dtypes, into fp64 bins.
SKETCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Segment boundaries of the L1 kernels already on a device, by (device, segment sizes): a bucket's layout repeats
# every step, so its offsets cross to the device once.
_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_OFFSETS_KEPT = 256


class CompiledPacking:
    """:class:`~ds_lioncub.comm.packing.layout.PackingOps` on a loaded op module; ``fallback`` takes what the kernels do
    not."""

    def __init__(self, module: Any, fallback: PackingOps) -> None:
        self.module = module
        self.fallback = fallback
        self.generation = kernel_generation() if getattr(module, "device", "cpu") == "cuda" else "v2"

    def kernel(self, name: str) -> Any:
        """The op's function ``name`` in the selected generation (:data:`KERNELS_ENV`), or None where it has none."""
        if self.generation == "v1":
            if name in SECOND_GENERATION_ONLY:
                return None
            if name in FIRST_GENERATION:
                return getattr(self.module, f"{name}_v1", None) or getattr(self.module, name, None)
        return getattr(self.module, name, None)

    def has_kernel(self, name: str) -> bool:
        return self.kernel(name) is not None

    def pack_fields(self, flat: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
        if flat.dtype not in FIELD_INPUT_DTYPES:
            return self.fallback.pack_fields(flat, bits, nbytes)
        out = _new_bytes(nbytes, flat)
        self.module.pack_fields(flat.contiguous(), bits, out)
        return out

    def unpack_fields(self, packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        if packed.dtype != MESSAGE_DTYPE:
            return self.fallback.unpack_fields(packed, bits, numel)
        out = _new_bytes(numel, packed)
        self.module.unpack_fields(packed.contiguous(), bits, out)
        return out

    def pack_signs(self, flat: torch.Tensor, zero_is_positive: bool, bits: int, nbytes: int) -> torch.Tensor:
        if flat.dtype not in SIGN_INPUT_DTYPES:
            return self.fallback.pack_signs(flat, zero_is_positive, bits, nbytes)
        out = _new_bytes(nbytes, flat)
        self.kernel("pack_signs")(flat.contiguous(), zero_is_positive, bits, out)
        return out

    def unpack_signs(
        self, packed: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor:
        if dtype not in SIGN_OUTPUT_DTYPES or packed.dtype != MESSAGE_DTYPE:
            return self.fallback.unpack_signs(packed, numel, dtype, out)
        target = torch.empty(numel, dtype=dtype, device=packed.device) if out is None else out
        self.kernel("unpack_signs")(packed.contiguous(), target)
        return target

    def sum_fields_per_position(self, rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        if rows.dtype != MESSAGE_DTYPE:
            return self.fallback.sum_fields_per_position(rows, bits, numel)
        out = torch.empty(numel, dtype=torch.int32, device=rows.device)
        self.module.sum_fields(rows.contiguous(), bits, numel, out)
        return out

    def vote_packed_signs(self, rows: torch.Tensor, numel: int, zero_is_positive: bool) -> torch.Tensor:
        if rows.dtype != MESSAGE_DTYPE:
            return self.fallback.vote_packed_signs(rows, numel, zero_is_positive)
        out = _new_bytes(packed_length(numel), rows)
        self.kernel("vote_packed_signs")(rows.contiguous(), numel, zero_is_positive, out)
        return out

    def vote_field_sums(self, rows: torch.Tensor, bits: int, numel: int, threshold: int) -> torch.Tensor:
        vote = self.kernel("vote_field_sums")
        if vote is None or rows.dtype != MESSAGE_DTYPE:
            # the composition, on this implementation's own kernels (a CPU step runs the kernels it ran before)
            sums = self.unpack_fields(rows[0], bits, numel) if rows.size(0) == 1 else None
            if sums is None:
                sums = self.sum_fields_per_position(rows, bits, numel)
            return self.pack_fields(at_least(sums, threshold), 1, packed_length(numel))
        out = _new_bytes(packed_length(numel), rows)
        vote(rows.contiguous(), bits, numel, threshold, out)
        return out

    def pack_l1_fields(
        self, flat: torch.Tensor, scales: torch.Tensor, sizes: list[int], levels: int, bits: int, nbytes: int
    ) -> torch.Tensor:
        if flat.dtype not in L1_INPUT_DTYPES:
            return self.fallback.pack_l1_fields(flat, scales, sizes, levels, bits, nbytes)
        # The kernel takes segment boundaries (int64, 0 first, numel last) next to the fp32 scales, both
        # on the device of the data.
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        if sizes:
            torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
        if flat.is_cuda:
            offsets, scales = offsets.to(flat.device), scales.to(flat.device)
        else:
            scales = scales.cpu()
        out = _new_bytes(nbytes, flat)
        self.module.quantize_l1_pack(flat.contiguous(), offsets, scales.contiguous(), levels, bits, out)
        return out

    def pack_l1_fields_of_means(
        self,
        flat: torch.Tensor,
        means: torch.Tensor,
        sizes: list[int],
        levels: int,
        clip: float,
        bits: int,
        nbytes: int,
    ) -> torch.Tensor:
        kernel = self.kernel("quantize_l1_means_pack")
        if kernel is None or flat.dtype not in L1_INPUT_DTYPES or not flat.is_cuda:
            # the scales in torch (l1_segment_scales), then this implementation's quantize-and-pack kernel
            from ds_lioncub.comm.quantize import l1_segment_scales

            _, scales = l1_segment_scales(flat, levels, clip, sizes, means)
            return self.pack_l1_fields(flat, scales, sizes, levels, bits, nbytes)
        offsets = _offsets_on(flat.device, sizes)
        means = means.to(device=flat.device, dtype=torch.float32).contiguous()
        out = _new_bytes(nbytes, flat)
        kernel(flat.contiguous(), offsets, means, levels, clip, bits, out)
        return out

    def lion_direction_pack_signs(
        self, pieces: Sequence[MomentumPiece], zero_is_positive: bool, bits: int, nbytes: int
    ) -> torch.Tensor:
        if not (hasattr(self.module, "lion_direction_pack_signs") and all(map(_fused_momentum, pieces))):
            return self.fallback.lion_direction_pack_signs(pieces, zero_is_positive, bits, nbytes)
        # 1 - beta as Python computes it in lion.py; the kernel rounds each scalar as torch does.
        scalars = [value for p in pieces for value in (p.beta1, 1 - p.beta1, p.beta2, 1 - p.beta2)]
        out = _new_bytes(nbytes, pieces[0].exp_avg)
        momenta = [piece.exp_avg for piece in pieces]
        grads = [piece.grad.contiguous() for piece in pieces]
        self.module.lion_direction_pack_signs(momenta, grads, scalars, zero_is_positive, bits, out)
        for piece in pieces:  # the kernel updates fp32 momentum only (see the module docstring)
            if piece.exp_avg.dtype != torch.float32:
                update_momentum(piece.exp_avg, piece.grad, piece.beta2)
        return out

    def apply_packed_signs(self, packed: torch.Tensor, pieces: Sequence[ParamPiece]) -> None:
        if not (
            hasattr(self.module, "apply_packed_signs")
            and packed.dtype == MESSAGE_DTYPE
            and all(piece.param.dtype in FUSED_STEP_DTYPES and piece.param.is_contiguous() for piece in pieces)
        ):
            self.fallback.apply_packed_signs(packed, pieces)
            return
        # (whether weight decay applies, 1 - lr * wd, -lr) as apply_update computes them
        scalars = [value for p in pieces for value in (float(p.weight_decay != 0), 1 - p.lr * p.weight_decay, -p.lr)]
        self.module.apply_packed_signs(packed.contiguous(), [piece.param for piece in pieces], scalars)

    def sketch_and_squares(
        self,
        pieces: Sequence[torch.Tensor],
        columns: Sequence[int],
        starts: Sequence[int],
        signs: torch.Tensor,
        period: int,
        out: torch.Tensor,
    ) -> None:
        if not (
            self.has_kernel("sketch_and_squares")
            and out.dtype == torch.float64
            and out.is_contiguous()
            and signs.dtype == MESSAGE_DTYPE
            and all(piece.dtype in SKETCH_DTYPES for piece in pieces)
        ):
            self.fallback.sketch_and_squares(pieces, columns, starts, signs, period, out)
            return
        contiguous = [piece if piece.is_contiguous() else piece.contiguous() for piece in pieces]
        self.module.sketch_and_squares(contiguous, columns, starts, signs.contiguous(), period, out)


def _fused_momentum(piece: MomentumPiece) -> bool:
    """Whether the fused kernel reproduces the torch composition for this piece (and can write its momentum)."""
    return (
        piece.exp_avg.dtype in FUSED_STEP_DTYPES
        and piece.grad.dtype == piece.exp_avg.dtype
        and piece.exp_avg.is_contiguous()
    )


def _new_bytes(nbytes: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _offsets_on(device: torch.device, sizes: Sequence[int]) -> torch.Tensor:
    """The segment boundaries (int64: 0, then the running sums of ``sizes``) on ``device``, made once per layout."""
    key = (device, tuple(sizes))
    offsets = _OFFSETS.get(key)
    if offsets is None:
        host = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        if sizes:
            torch.cumsum(torch.tensor(list(sizes), dtype=torch.int64), 0, out=host[1:])
        offsets = host.to(device)
        if len(_OFFSETS) >= _OFFSETS_KEPT:
            _OFFSETS.pop(next(iter(_OFFSETS)))
        _OFFSETS[key] = offsets
    return offsets


__all__ = [
    "FIELD_INPUT_DTYPES",
    "FIRST_GENERATION",
    "KERNELS_ENV",
    "SECOND_GENERATION_ONLY",
    "FUSED_STEP_DTYPES",
    "L1_INPUT_DTYPES",
    "MESSAGE_DTYPE",
    "SIGN_INPUT_DTYPES",
    "SIGN_OUTPUT_DTYPES",
    "SKETCH_DTYPES",
    "CompiledPacking",
    "kernel_generation",
]
