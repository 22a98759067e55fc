"""The error-compensated 1-bit average that DeepSpeed <= 0.19.7 shipped for 1-bit Adam.

Four steps, each compression keeping what it lost in an error buffer that is added back next call:

1. worker: ``x = buffer + worker_error``; send ``sign(x)`` with one scale ``||x|| / sqrt(n)``;
2. exchange: all-to-all of the packed signs, all-gather of the scales;
3. server (each rank owns one chunk): ``y = server_error + mean over senders of scale_s * sign_s``,
   compressed the same way;
4. all-gather of the server signs and scales: every rank reconstructs the same average.
"""

from __future__ import annotations

import math

import torch

from ds_lioncub.comm.packing import pack_fields, unpack_signs
from ds_lioncub.comm.transport import Transport
from ds_lioncub.errors import LionCubConfigError


def legacy_padded_numel(numel: int, world_size: int) -> int:
    """Size DeepSpeed's 1-bit optimizers gave ``worker_error``: ``numel`` rounded up to p*lcm(p, 8)."""
    multiple = world_size * math.lcm(world_size, 8)
    return (numel + multiple - 1) // multiple * multiple


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    if flat.numel() == length:
        return flat
    return torch.cat([flat, flat.new_zeros(length - flat.numel())])


def _compress_with_error(x: torch.Tensor, error_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positive, scale)`` of the 1-bit compression ``scale * sign(x)``; what it loses goes to ``error_out``."""
    scale = x.norm() / math.sqrt(x.numel())
    positive = x >= 0
    error_out.copy_(x - scale * (positive.float() * 2 - 1))
    return positive, scale


def compressed_allreduce(
    transport: Transport, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor
) -> torch.Tensor:
    """Error-compensated 1-bit average of ``buffer_m`` over ``transport``'s ranks, written into ``buffer_m``.

    ``worker_error`` holds the padded size (a multiple of 8*p; see :func:`legacy_padded_numel`),
    ``server_error`` that size / p. Both are updated in place.
    """
    p = transport.world_size
    padded_numel = worker_error.numel()
    if padded_numel % (8 * p) != 0 or padded_numel < buffer_m.numel():
        raise LionCubConfigError(
            f"LionCub: compressed_allreduce: worker_error has {padded_numel} elements; it must be at least "
            f"buffer_m.numel() ({buffer_m.numel()}) and a multiple of 8 * world_size ({8 * p}). "
            f"Allocate it with ds_lioncub.comm.legacy_padded_numel(numel, world_size) elements."
        )
    if server_error.numel() * p != padded_numel:
        raise LionCubConfigError(
            f"LionCub: compressed_allreduce: server_error must have worker_error.numel() / world_size = "
            f"{padded_numel // p} elements, got {server_error.numel()}."
        )
    chunk_numel = padded_numel // p
    x = _padded(buffer_m.reshape(-1).float(), padded_numel) + worker_error.view(-1)
    worker_positive, worker_scale = _compress_with_error(x, worker_error.view(-1))

    received_signs = transport.all_to_all(pack_fields(worker_positive, 1)).view(p, -1)
    worker_scales = transport.all_gather(worker_scale.reshape(1))

    y = server_error.view(-1).clone()
    for sender in range(p):
        y.add_(unpack_signs(received_signs[sender], chunk_numel) * (worker_scales[sender] / p))
    server_positive, server_scale = _compress_with_error(y, server_error.view(-1))

    gathered_signs = transport.all_gather(pack_fields(server_positive, 1)).view(p, -1)
    server_scales = transport.all_gather(server_scale.reshape(1))
    result = torch.cat([unpack_signs(gathered_signs[r], chunk_numel) * server_scales[r] for r in range(p)])
    buffer_m.copy_(result[: buffer_m.numel()].view(buffer_m.shape))
    return buffer_m


__all__ = ["compressed_allreduce", "legacy_padded_numel"]
