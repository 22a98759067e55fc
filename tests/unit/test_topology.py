"""The hybrid layout: node groups and vote groups, and where the node size comes from."""

from __future__ import annotations

import pytest

from ds_lioncub.comm.topology import NODE_SIZE_VARIABLES, plan_hybrid, resolve_node_size
from ds_lioncub.errors import LionCubConfigError


@pytest.mark.parametrize("world,node_size", [(4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (12, 3), (1, 1)])
def test_every_rank_is_in_one_node_and_one_vote_group_with_the_same_local_index(world: int, node_size: int) -> None:
    layout = plan_hybrid(world, node_size)
    assert layout.nodes * layout.node_size == world
    for rank in range(world):
        nodes = [k for k, members in enumerate(layout.node_groups) if rank in members]
        votes = [j for j, members in enumerate(layout.vote_groups) if rank in members]
        assert nodes == [rank // node_size] and votes == [rank % node_size]
        assert layout.node_of(rank) == nodes[0] and layout.local_index_of(rank) == votes[0]
    for members in layout.node_groups:  # a node is a block of consecutive ranks (launchers number node-major)
        assert list(members) == list(range(members[0], members[0] + node_size))
    for j, members in enumerate(layout.vote_groups):  # one rank per node, all with local index j
        assert [m // node_size for m in members] == list(range(layout.nodes)) and {m % node_size for m in members} == {
            j
        }


def test_two_nodes_of_two_as_the_tests_emulate_them() -> None:
    layout = plan_hybrid(4, 2)
    assert layout.node_groups == ((0, 1), (2, 3)) and layout.vote_groups == ((0, 2), (1, 3))


@pytest.mark.parametrize("world,node_size", [(4, 3), (6, 4), (4, 0), (4, 8)])
def test_a_node_size_that_does_not_divide_the_world_is_refused(world: int, node_size: int) -> None:
    with pytest.raises(LionCubConfigError, match=f"node_size={node_size} does not divide.*{world} ranks"):
        plan_hybrid(world, node_size)


def test_the_option_wins_over_the_environment() -> None:
    assert resolve_node_size(2, {"LOCAL_WORLD_SIZE": "8"}) == (2, "hybrid.node_size")


@pytest.mark.parametrize("name", NODE_SIZE_VARIABLES)
def test_each_launcher_variable_gives_the_node_size(name: str) -> None:
    assert resolve_node_size(None, {name: "4"}) == (4, f"environment variable {name}")


def test_launcher_variables_are_consulted_in_order() -> None:
    environ = {name: str(index + 1) for index, name in enumerate(NODE_SIZE_VARIABLES)}
    assert resolve_node_size(None, environ)[0] == 1
    environ.pop(NODE_SIZE_VARIABLES[0])
    assert resolve_node_size(None, environ) == (2, f"environment variable {NODE_SIZE_VARIABLES[1]}")


def test_no_node_size_anywhere_asks_for_the_option() -> None:
    with pytest.raises(LionCubConfigError, match='set "hybrid": {"node_size": G}'):
        resolve_node_size(None, {})


def test_a_malformed_launcher_variable_is_named() -> None:
    with pytest.raises(LionCubConfigError, match="LOCAL_SIZE='two'"):
        resolve_node_size(None, {"LOCAL_SIZE": "two"})
