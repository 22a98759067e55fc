"""The tie rule and the L1 quantizer, in their readable reference forms.

- the tie rule: what a zero (a local sign of 0, or a vote sum of 0) resolves to;
- the L1 quantizer of the Lion Cub paper (section 4.2), and the per-segment scales it multiplies by
  (:func:`l1_segment_scales`: one per parameter tensor of a bucket), which the optimizer's k-bit
  aggregation and the public ``CompressedBackend.vote_kbit`` both take from here.

Field widths and world-size limits of summed fields are in :mod:`ds_lioncub.comm.kbit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_lioncub.comm.kbit import (  # noqa: F401 - re-exported while callers move to comm.kbit
    KBIT_WIDTHS,
    check_kbit_world_size,
    field_width_for,
    l1_levels,
    max_allreduce_world_size,
)
from ds_lioncub.comm.vocabulary import KbitAlgorithm, Quantizer, TieBreak  # noqa: F401
from ds_lioncub.errors import LionCubConfigError


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


def l1_segment_scales(
    flat: torch.Tensor,
    levels: int,
    clip: float,
    segment_sizes: Sequence[int] | None,
    segment_means: Sequence[float] | Sequence[torch.Tensor] | torch.Tensor | None,
) -> tuple[list[int], torch.Tensor]:
    """Segment sizes and each segment's L1 scale ``L / (clip * mu)`` (0 where mu == 0).

    ``mu`` is ``segment_means[i]`` when given (a segment that is a slice of a larger tensor uses the
    whole tensor's mean), else the mean absolute value of the segment itself.
    """
    sizes = [flat.numel()] if segment_sizes is None else [int(s) for s in segment_sizes]
    if sum(sizes) != flat.numel() or any(s < 0 for s in sizes):
        raise LionCubConfigError(
            f"LionCub: segment_sizes must be non-negative and add up to the update's numel "
            f"({flat.numel()}), got a total of {sum(sizes)}."
        )
    if segment_means is not None and len(segment_means) != len(sizes):
        raise LionCubConfigError("LionCub: segment_means needs one value per segment.")
    scales = []
    start = 0
    for index, size in enumerate(sizes):
        segment = flat[start : start + size]
        mean_abs: torch.Tensor | float
        if segment_means is None:
            mean_abs = segment.float().abs().mean() if size else torch.zeros(())
        else:
            mean_abs = segment_means[index]
        scales.append(l1_scale(mean_abs, levels, clip).cpu())
        start += size
    return sizes, torch.stack(scales) if scales else torch.zeros(0)
