"""The L1 quantizer (docs/design.md, section 4.1) for the brute-force references, in plain torch.

``q = clamp(round(c * s), -L, L)`` with the scale ``s = L / (clip * mu)`` and ``mu`` the mean |c| of the
tensor ``c`` belongs to (docs/design.md, sections 4.1 and 4.7). Written from those definitions with no
ds_lioncub code, but in the order the design fixes, because a value on a rounding boundary is decided by the
fp32 roundings on the way there:

- ``s`` is one fp32 scalar per tensor, the expression ``L / (clip * mu)`` on an fp32 0-dim ``mu`` (torch
  rounds ``clip * mu``, then takes ``L`` times its reciprocal), and ``c`` is multiplied by it, rounded once;
  ``c / mu * L / clip`` rounds three times and lands a level apart now and then
  (tests/unit/test_l1_reference.py builds such inputs);
- ``round`` is torch's, half to even;
- ``mu`` of a tensor longer than the bucket capacity is |c| summed one capacity-sized chunk at a time into
  an fp32 total, divided by its length (the optimizer never holds the whole tensor's c); a tensor that fits
  a bucket takes its own ``abs().mean()``. The two differ in the last bit of mu for 836 of 2,000 random
  2,560-element tensors at chunks of 1,024.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def segment_mean_abs(c: Tensor, capacity: int | None = None) -> Tensor:
    """fp32 mu of ``c`` (flat): ``abs().mean()``, or chunk-wise sums when ``c`` is longer than ``capacity``."""
    work = c.reshape(-1).float()
    if capacity is None or work.numel() <= capacity:
        return work.abs().mean()
    total = torch.zeros((), dtype=torch.float32)
    for start in range(0, work.numel(), capacity):
        total += work[start : start + capacity].abs().sum()
    return total / work.numel()


def l1_scale(mu: Tensor | float, levels: int, clip: float) -> Tensor:
    """The fp32 scalar ``L / (clip * mu)``; 0 when mu is not positive (0, or NaN for an empty tensor)."""
    mu = torch.as_tensor(mu, dtype=torch.float32)
    if not bool(mu > 0):
        return torch.zeros((), dtype=torch.float32)
    return levels / (clip * mu)


def l1_quantize(c: Tensor, levels: int, clip: float, mean_abs: float | Tensor | None = None) -> Tensor:
    """int32 ``q = clamp(round(c * L / (clip * mu)), -L, L)`` in c's shape, mu = mean |c| unless given; 0 where
    mu is not positive. ``c`` is taken in fp32 whatever its dtype, as the optimizer's buckets hold it."""
    work = c.float()
    mu = work.abs().mean() if mean_abs is None else mean_abs
    scale = l1_scale(mu, levels, clip)
    if not bool(scale > 0):
        return torch.zeros(c.shape, dtype=torch.int32)
    return torch.round(work * scale).clamp(-levels, levels).to(torch.int32)


def l1_quantize_segments(
    flat: Tensor, levels: int, clip: float, segment_sizes: Sequence[int] | None, capacity: int | None = None
) -> Tensor:
    """:func:`l1_quantize` per segment (per parameter tensor, each with its own mu); ``capacity``: the bucket
    size, past which a segment's mu is summed chunk-wise (:func:`segment_mean_abs`), None for never."""
    sizes = [flat.numel()] if segment_sizes is None else list(segment_sizes)
    if sum(sizes) != flat.numel() or any(s < 0 for s in sizes):
        raise ValueError(f"segment_sizes {sizes} do not split {flat.numel()} elements")
    parts = []
    start = 0
    for size in sizes:
        segment = flat[start : start + size]
        parts.append(l1_quantize(segment, levels, clip, segment_mean_abs(segment, capacity)))
        start += size
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
