"""plan_buckets: hand-worked plans, and a loop that checks every element is covered exactly once."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_lioncub.step.bucket_plan import Piece, plan_buckets


def P(index: int, start: int, length: int) -> Piece:
    return Piece(index, start, length)


@pytest.mark.parametrize(
    ("numels", "capacity", "expected"),
    [
        # 3 + 4 fit together; 2 more would overflow 8, so the third tensor starts bucket 2.
        ([3, 4, 2], 8, [[P(0, 0, 3), P(1, 0, 4)], [P(2, 0, 2)]]),
        # a tensor that fits a bucket is never split: 5 + 5 > 8, so the second starts a new bucket.
        ([5, 5], 8, [[P(0, 0, 5)], [P(1, 0, 5)]]),
        # exact fits
        ([8], 8, [[P(0, 0, 8)]]),
        ([4, 4, 8], 8, [[P(0, 0, 4), P(1, 0, 4)], [P(2, 0, 8)]]),
        # a tensor larger than a bucket is cut into capacity-sized pieces; the 4-element tail of
        # tensor 1 shares its bucket with tensor 2.
        ([3, 20, 2], 8, [[P(0, 0, 3)], [P(1, 0, 8)], [P(1, 8, 8)], [P(1, 16, 4), P(2, 0, 2)]]),
        ([16], 8, [[P(0, 0, 8)], [P(0, 8, 8)]]),
        # empty tensors are skipped (their index never appears)
        ([0, 3, 0, 0, 5], 8, [[P(1, 0, 3), P(4, 0, 5)]]),
        ([0, 0], 8, []),
        ([], 8, []),
        ([1, 1, 1], 1, [[P(0, 0, 1)], [P(1, 0, 1)], [P(2, 0, 1)]]),
    ],
)
def test_hand_worked_plans(numels: list[int], capacity: int, expected: list[list[Piece]]) -> None:
    assert plan_buckets(numels, capacity) == expected


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="0"):
        plan_buckets([1, 2], 0)


def check_plan(numels: list[int], capacity: int, buckets: list[list[Piece]]) -> None:
    covered = [[0] * n for n in numels]
    order = []
    for bucket in buckets:
        assert bucket, "empty bucket"
        assert sum(piece.length for piece in bucket) <= capacity
        for piece in bucket:
            assert piece.length > 0
            if numels[piece.tensor_index] <= capacity:
                # small tensors travel whole
                assert (piece.start, piece.length) == (0, numels[piece.tensor_index])
            for element in range(piece.start, piece.start + piece.length):
                covered[piece.tensor_index][element] += 1
            order.append((piece.tensor_index, piece.start))
    for index, counts in enumerate(covered):
        assert all(count == 1 for count in counts), f"tensor {index}: coverage {counts}"
    # Pieces come in flat order (tensor by tensor, front to back), so concatenating the buckets
    # reproduces the concatenation of the tensors.
    assert order == sorted(order)


@pytest.mark.parametrize("seed", range(30))
def test_random_plans_cover_every_element_once(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 7, 8, 16, 100])
    numels = [
        rng.choice([0, 1, rng.randint(1, capacity), rng.randint(1, 4 * capacity + 3)])
        for _ in range(rng.randint(0, 25))
    ]
    buckets = plan_buckets(numels, capacity)
    check_plan(numels, capacity, buckets)
    # Greedy packing: a bucket closes only when the next piece would not fit.
    for bucket, following in itertools.pairwise(buckets):
        assert sum(piece.length for piece in bucket) + following[0].length > capacity
