"""Ranks built with different options or models: the same clear error on every rank, never a hang.

Three real gloo ranks; rank 1 differs from ranks 0 and 2 in one thing per scenario
(tests/workers/set_up_scenarios.py). A scenario that raises must leave every rank ready for the next
one, which the final identical scenario shows by completing a vote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.checks import same_message_on_every_rank
from tests.support.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

WORKER = REPO / "tests" / "workers" / "set_up_scenarios.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> list[dict[str, Any]]:
    # A hang would fail here at the time limit instead of blocking the suite.
    return run_ranks(WORKER, 3, Path(tmp_path_factory.mktemp("set-up")), timeout_s=120)


@pytest.mark.parametrize("scenario", ["same", "same_again", "checked"])
def test_ranks_built_alike_train(ranks: list[dict[str, Any]], scenario: str) -> None:
    assert all(results[scenario] is None for results in ranks)


@pytest.mark.parametrize(
    ("scenario", "fragments"),
    [
        ("compression", ["option compression", "ranks 0, 2: '1bit'", "rank 1: 'kbit'"]),
        ("lr", ["option lr", "ranks 0, 2: 0.01", "rank 1: 0.02"]),
        ("shape", ["parameter #0", "ranks 0, 2: w (4, 3) float32", "rank 1: w (4, 2) float32"]),
        ("count", ["param groups (size, lr, betas, weight_decay)", "ranks 0, 2: [(2,", "rank 1: [(3,"]),
        ("dtype", ["parameter #1", "rank 1: b (4,) float64"]),
    ],
)
def test_a_rank_built_differently_raises_the_same_error_on_every_rank(
    ranks: list[dict[str, Any]], scenario: str, fragments: list[str]
) -> None:
    message = same_message_on_every_rank(ranks, scenario)
    assert message.startswith("LionCubConfigError: LionCub: the ranks"), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    ("scenario", "fragments"),
    [
        ("auto_node_size_differs", ["the ranks differ in the ranks per node", "ranks 0, 2: 3; rank 1: 1"]),
        ("auto_node_size_invalid", ["could not be worked out on rank(s) 1 of 3", "LIONCUB_NODE_SIZE"]),
        ("auto_on_one_rank", ["the ranks", "option compression", "ranks 0, 2: '1bit'", "rank 1: 'auto'"]),
    ],
)
def test_auto_plans_only_with_a_node_size_every_rank_shares(
    ranks: list[dict[str, Any]], scenario: str, fragments: list[str]
) -> None:
    """compression="auto" reads G from each rank's environment: a rank that differs, or cannot read it,
    stops every rank with one message instead of resolving alone while the others wait; so does one
    rank asking for "auto" where the others do not."""
    message = same_message_on_every_rank(ranks, scenario)
    assert message.startswith("LionCubConfigError: LionCub: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_a_parameter_changed_on_one_rank_is_caught_at_the_next_check_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """consistency_check every 2 steps; rank 1 changes 'b' after step 2: every rank raises at step 4."""
    message = same_message_on_every_rank(ranks, "perturbed")
    assert message.startswith("LionCubSetupError: LionCub: the ranks' parameters differ after step 4"), message
    assert "first at 'b'" in message and "ranks 0, 2 vs ranks 1" in message, message
