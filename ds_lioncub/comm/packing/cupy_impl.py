"""The cupy implementation for CUDA tensors: ``cupy.packbits``/``unpackbits`` for the 1-bit layouts.

``auto`` takes it for CUDA tensors when the compiled CUDA op is unavailable (no CUDA toolkit, a failed
build) and cupy imports. Only the 1-bit layouts go to cupy; wider fields and the L1 quantizer stay
in torch. The signs, the counts and the vote reach cupy through the 1-bit ``pack_fields`` and
``unpack_fields`` that :class:`~.torch_impl.TorchPacking` builds them on.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_lioncub.comm.packing.layout import packed_length
from ds_lioncub.comm.packing.torch_impl import TorchPacking, pad_bytes


class CupyPacking(TorchPacking):
    """:class:`~.layout.PackingOps` for CUDA tensors with cupy doing the 1-bit layouts."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def pack_fields(self, flat: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
        if bits != 1:
            return super().pack_fields(flat, bits, nbytes)
        return pad_bytes(self._pack_bits(flat), nbytes)

    def unpack_fields(self, packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        if bits != 1:
            return super().unpack_fields(packed, bits, numel)
        return self._unpack_bits(packed, numel)

    def _pack_bits(self, flat: torch.Tensor) -> torch.Tensor:
        bits = flat if flat.dtype == torch.bool else flat.to(torch.uint8).bitwise_and_(1).bool()
        if bits.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device)
        packed = self.cupy.packbits(self.cupy.from_dlpack(bits.contiguous()), bitorder="little")
        return torch.from_dlpack(packed)

    def _unpack_bits(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.uint8, device=packed.device)
        source = packed.reshape(-1)[: packed_length(numel)].contiguous()
        bits = self.cupy.unpackbits(self.cupy.from_dlpack(source), bitorder="little")
        return torch.from_dlpack(bits)[:numel]


__all__ = ["CupyPacking"]
