"""Grouping parameters into fixed-size communication buckets.

A step communicates bucket by bucket, so it issues a bounded number of collectives (not one per
tensor) and its temporaries are bounded by the bucket, not by the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Piece(NamedTuple):
    """Elements ``[start, start + length)`` of the flattened tensor number ``tensor_index``."""

    tensor_index: int
    start: int
    length: int


def plan_buckets(numels: Sequence[int], capacity: int) -> list[list[Piece]]:
    """Assign tensors, in order, to buckets of at most ``capacity`` elements.

    A tensor that fits in one bucket is never split (it starts a new bucket instead); only tensors
    larger than a bucket are cut, into capacity-sized pieces. Empty tensors are skipped.
    """
    if capacity < 1:
        raise ValueError(f"bucket capacity must be >= 1, got {capacity}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, numel in enumerate(numels):
        if numel == 0:
            continue
        if numel <= capacity:
            if used + numel > capacity:
                buckets.append(current)
                current, used = [], 0
            current.append(Piece(index, 0, numel))
            used += numel
            continue
        for start in range(0, numel, capacity):
            length = min(capacity, numel - start)
            if used + length > capacity:
                buckets.append(current)
                current, used = [], 0
            current.append(Piece(index, start, length))
            used += length
    if current:
        buckets.append(current)
    return buckets
