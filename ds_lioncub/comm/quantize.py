"""Turning an fp32 update into small non-negative integers, and back.

- the tie rule: what a zero (a local sign of 0, or a vote sum of 0) resolves to;
- the L1 quantizer of the Lion Cub paper (section 4.2);
- field widths: how many levels a b-bit field can carry for p workers without carrying into its
  neighbour when fields are summed.
"""

from __future__ import annotations

from typing import Literal

import torch

TieBreak = Literal["alternate", "positive"]
Quantizer = Literal["sign", "l1"]
KbitAlgorithm = Literal["allreduce", "alltoall"]
KBIT_WIDTHS = (2, 4, 8)


def tie_sign(step: int, tie_break: TieBreak) -> int:
    """The sign a zero resolves to at optimizer step ``step`` (1-based).

    "alternate" gives +1 on odd steps and -1 on even ones, so ties do not push every tied coordinate
    the same way step after step; "positive" (always +1) exists for ablations.
    """
    if tie_break == "alternate":
        return 1 if step % 2 == 1 else -1
    if tie_break == "positive":
        return 1
    raise ValueError(f"tie_break must be 'alternate' or 'positive', got {tie_break!r}")


def sign_with_tie(x: torch.Tensor, step: int, tie_break: TieBreak) -> torch.Tensor:
    """+1/-1 in ``x.dtype``; exact zeros follow the tie rule."""
    if tie_sign(step, tie_break) > 0:
        positive = x >= 0
    else:
        positive = x > 0
    return positive.to(x.dtype).mul_(2).sub_(1)


def field_width_for(max_value: int) -> int:
    """Smallest packable width (1, 2, 4, 8, 16 or 32 bits) that holds ``max_value``."""
    for width in (1, 2, 4, 8, 16, 32):
        if max_value <= (1 << width) - 1:
            return width
    raise ValueError(f"value {max_value} does not fit in 32 bits")


def l1_levels(world_size: int, bits: int, algorithm: KbitAlgorithm) -> int:
    """Quantization levels L (q in [-L, L]) for the L1 quantizer.

    With "allreduce" the p fields are summed inside one b-bit field, so the sum of the shifted values
    q + L (at most 2L each) must fit: p * 2L <= 2**b - 1. With "alltoall" the receiving rank sums in
    int32, so only one worker's value has to fit.
    """
    top = (1 << bits) - 1
    if algorithm == "allreduce":
        return top // (2 * world_size)
    return top // 2


def max_allreduce_world_size(bits: int, quantizer: Quantizer) -> int:
    """Largest p for which p fields of this quantizer can be summed in a b-bit field."""
    top = (1 << bits) - 1
    return top if quantizer == "sign" else top // 2


def check_kbit_world_size(world_size: int, bits: int, quantizer: Quantizer, algorithm: KbitAlgorithm) -> None:
    """Raise a ValueError naming the fix when the world is too large for summed b-bit fields."""
    if bits not in KBIT_WIDTHS:
        raise ValueError(f"LionCub: bits must be one of {KBIT_WIDTHS}, got {bits!r}.")
    if algorithm != "allreduce":
        return
    largest = max_allreduce_world_size(bits, quantizer)
    if world_size <= largest:
        return
    wider = [b for b in KBIT_WIDTHS if b > bits and max_allreduce_world_size(b, quantizer) >= world_size]
    wider_hint = f"bits={wider[0]}, " if wider else ""
    raise ValueError(
        f"LionCub: {bits}-bit '{quantizer}' fields summed with kbit_algorithm='allreduce' hold at most "
        f"{largest} workers, but the data-parallel world has {world_size}. Use {wider_hint}"
        f"kbit_algorithm='alltoall' (field width independent of the world size), or compression='1bit'."
    )


def quantize_l1(c: torch.Tensor, mean_abs: torch.Tensor | float, levels: int, clip: float) -> torch.Tensor:
    """L1 quantizer: ``q = clamp(round(c / mu * L / clip), -L, L)`` as int32, ``q = 0`` when mu == 0.

    Scaling by the mean absolute value (not the max) keeps most of a heavy-tailed update away from
    0; ``clip`` (tau) says at how many multiples of mu a coordinate saturates.
    """
    mean_abs = torch.as_tensor(mean_abs, dtype=torch.float32, device=c.device)
    if not bool(mean_abs > 0):
        return torch.zeros(c.shape, dtype=torch.int32, device=c.device)
    scale = l1_scale(mean_abs, levels, clip)
    q = torch.round(c.float() * scale).clamp_(-levels, levels)
    return q.to(torch.int32)


def l1_scale(
    mean_abs: torch.Tensor | float, levels: int, clip: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """The fp32 factor ``L / (clip * mu)`` that :func:`quantize_l1` multiplies ``c`` by; 0 when mu is
    not positive (then every q is 0). The packing kernels take this very value, so both round alike."""
    mean_abs = torch.as_tensor(mean_abs, dtype=torch.float32, device=device)
    if not bool(mean_abs > 0):
        return torch.zeros((), dtype=torch.float32, device=mean_abs.device)
    return levels / (clip * mean_abs)
