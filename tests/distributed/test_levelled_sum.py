"""The ZeRO hybrid's world-wide sum in levels (ds_lioncub/comm/transport/levels.py) on 1-4 real gloo ranks.

Against a plain loop of its definition: every node's total in rank order, then the nodes' totals in node order.
The floats span sixteen orders of magnitude, so a sum in any other order (the world's rank order, say) would
differ in its last bits somewhere, and every rank must hold the same bits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_lioncub.comm import wire
from tests.support import scenarios as sc
from tests.support.checks import same_on_every_rank

pytestmark = pytest.mark.distributed


def node_then_across(world_size: int) -> torch.Tensor:
    node_size = sc.levelled_sum_node_size(world_size)
    inputs = [sc.levelled_sum_input(rank) for rank in range(world_size)]
    totals = []
    for first in range(0, world_size, node_size):
        total = inputs[first].clone()
        for rank in range(first + 1, first + node_size):
            total += inputs[rank]
        totals.append(total)
    result = totals[0]
    for total in totals[1:]:
        result += total
    return result


def test_the_sum_goes_inside_each_node_then_across_and_is_the_same_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    world_size = len(ranks)
    floats = same_on_every_rank(ranks, "levelled/floats")
    expected = node_then_across(world_size)
    assert torch.equal(floats, expected)
    if world_size == 4:  # the data tell the orders apart: the world's rank order gives other bits
        flat = sc.levelled_sum_input(0).clone()
        for rank in range(1, world_size):
            flat += sc.levelled_sum_input(rank)
        assert not torch.equal(flat, expected)
    integers = same_on_every_rank(ranks, "levelled/integers")
    assert integers.tolist() == [world_size * (world_size + 1) // 2, world_size]


def test_it_spans_the_world_and_sends_one_all_reduce_per_level(ranks: list[dict[str, Any]]) -> None:
    world_size = len(ranks)
    node_size = sc.levelled_sum_node_size(world_size)
    nodes = world_size // node_size
    per_level = [(8 * sc.LEVELLED_SUM_SIZE, size) for size in (node_size, nodes)] + [(8, node_size), (8, nodes)]
    expected = sum(wire.all_reduce_bytes(nbytes, size) for nbytes, size in per_level)
    for rank, results in enumerate(ranks):
        assert results["levelled/world_size"] == world_size, f"rank {rank}"
        assert results["levelled/bytes_sent"] == expected, f"rank {rank}"
