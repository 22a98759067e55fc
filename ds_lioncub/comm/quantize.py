"""The tie rule and the L1 quantizer, in their readable reference forms.

- the tie rule: what a zero (a local sign of 0, or a vote sum of 0) resolves to;
- the L1 quantizer of the Lion Cub paper (section 4.2).

Field widths and world-size limits of summed fields are in :mod:`ds_lioncub.comm.kbit`.
"""

from __future__ import annotations

import torch

from ds_lioncub.comm.kbit import (  # noqa: F401 - re-exported while callers move to comm.kbit
    KBIT_WIDTHS,
    check_kbit_world_size,
    field_width_for,
    l1_levels,
    max_allreduce_world_size,
)
from ds_lioncub.comm.vocabulary import KbitAlgorithm, Quantizer, TieBreak  # noqa: F401


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
    """+1/-1 in ``x.dtype``; exact zeros follow the tie rule.

    The tie rule in tensor form, for readers and tests; the collectives take the rule as one
    ``positive_ties`` boolean and apply it while packing.
    """
    if tie_sign(step, tie_break) > 0:
        positive = x >= 0
    else:
        positive = x > 0
    return positive.to(x.dtype).mul_(2).sub_(1)


def quantize_l1(c: torch.Tensor, mean_abs: torch.Tensor | float, levels: int, clip: float) -> torch.Tensor:
    """L1 quantizer: ``q = clamp(round(c / mu * L / clip), -L, L)`` as int32, ``q = 0`` when mu == 0.

    Scaling by the mean absolute value (not the max) keeps most of a heavy-tailed update away from
    0; ``clip`` (tau) says at how many multiples of mu a coordinate saturates.

    The readable reference form: the optimizer quantizes and packs in one pass with
    :func:`ds_lioncub.comm.packing.pack_l1_fields`, which multiplies by the same :func:`l1_scale`.
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
