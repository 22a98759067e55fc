"""The compiled implementation: the op-builder kernels of ``ops/csrc`` (C++/OpenMP/AVX2 on CPU, CUDA on GPU).

The kernels write into preallocated outputs and read contiguous inputs of a few dtypes, listed once
below. Any other dtype goes to the pure torch implementation, which gives the same bytes: an exotic
dtype costs speed, never a failure. The CPU and CUDA ops have the same functions, so one class serves
both; :mod:`.dispatch` loads the op for the device and builds one :class:`CompiledPacking` around it.

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
row: the same bits, threads or not (each thread owns a range of bins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_lioncub.comm.packing.layout import MomentumPiece, PackingOps, ParamPiece, packed_length
from ds_lioncub.lion import update_momentum

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


class CompiledPacking:
    """:class:`~.layout.PackingOps` on a loaded op module; ``fallback`` takes what the kernels do not."""

    def __init__(self, module: Any, fallback: PackingOps) -> None:
        self.module = module
        self.fallback = fallback

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
        self.module.pack_signs(flat.contiguous(), zero_is_positive, bits, out)
        return out

    def unpack_signs(
        self, packed: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor:
        if dtype not in SIGN_OUTPUT_DTYPES or packed.dtype != MESSAGE_DTYPE:
            return self.fallback.unpack_signs(packed, numel, dtype, out)
        target = torch.empty(numel, dtype=dtype, device=packed.device) if out is None else out
        self.module.unpack_signs(packed.contiguous(), target)
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
        self.module.vote_packed_signs(rows.contiguous(), numel, zero_is_positive, out)
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
            hasattr(self.module, "sketch_and_squares")
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


__all__ = [
    "FIELD_INPUT_DTYPES",
    "FUSED_STEP_DTYPES",
    "L1_INPUT_DTYPES",
    "MESSAGE_DTYPE",
    "SIGN_INPUT_DTYPES",
    "SIGN_OUTPUT_DTYPES",
    "SKETCH_DTYPES",
    "CompiledPacking",
]
