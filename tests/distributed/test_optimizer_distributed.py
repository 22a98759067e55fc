"""LionCub training on 1-4 real gloo ranks, against a single-process Lion and a brute-force simulation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import checks
from tests.support import scenarios as sc
from tests.support.reference import reference_lion_step

pytestmark = pytest.mark.distributed

PARAM_NAMES = list(sc.PARAM_SHAPES)


def test_parameters_bitwise_identical_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    checks.parameters_identical_on_every_rank(ranks)


def test_training_matches_brute_force_simulation(ranks: list[dict[str, Any]]) -> None:
    # bf16 gradient averaging is checked against fp32 below.
    checks.training_matches_brute_force_simulation(ranks, exact_modes=checks.ORDER_FREE_MODES)


def test_sign_votes_train_the_same_bits_on_the_torch_and_the_compiled_packing(ranks: list[dict[str, Any]]) -> None:
    # The sign-vote modes ran twice on every rank: on the path the environment selects (the fused kernels
    # when compiled) and forced to the torch composition; parameters and momenta must match bit for bit.
    if ranks[0]["packing-path"] != "compiled":
        pytest.skip(f"the ranks ran the {ranks[0]['packing-path']} packing path, not the compiled one")
    compared = 0
    for rank in ranks:
        for key, value in rank.items():
            if key.startswith("torch-packing/train-param/") or key.startswith("torch-packing/train-exp-avg/"):
                assert torch.equal(rank[key.removeprefix("torch-packing/")], value), key
                compared += 1
    assert compared >= len(ranks) * 2 * len(PARAM_NAMES) * 4  # four or five sign-vote modes per world


def test_pipelined_buckets_give_the_serial_steps_bits_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    checks.pipelined_buckets_match_serial_buckets(ranks)


@pytest.mark.parametrize("case", sc.OVERLAP_CASES)
def test_overlap_with_backward_gives_the_same_bits_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(ranks):
        for name in PARAM_NAMES:
            for kind in ("param", "exp-avg"):
                on, off = results[f"overlap-on/{case}/{kind}/{name}"], results[f"overlap-off/{case}/{kind}/{name}"]
                assert (on is None and off is None) or torch.equal(on, off), f"rank {rank}: {kind} {name}"
        for step in range(1, sc.TRAIN_STEPS + 1):  # the same refusals, with the same message
            assert results.get(f"overlap-on/{case}/error/{step}") == results.get(f"overlap-off/{case}/error/{step}")
        assert results[f"overlap-off/{case}/revoted"] == 0
        # 4 buckets of <= 1024 elements per step, all launched from the hooks; the plan starts with the bucket
        # of b2, so the rank whose loss leaves b2 out (rank 0) waits and launches everything at step()
        launched = results[f"overlap-on/{case}/launched-in-backward"]
        unused_here = sc.OVERLAP_CASES[case][3] == rank
        assert launched == (0 if len(ranks) == 1 or unused_here else 4 * sc.TRAIN_STEPS), f"rank {rank}"
        if case in ("1bit-clip", "1bit-option-clip") and len(ranks) > 1:
            assert results[f"overlap-on/{case}/revoted"] > 0, "clipping after backward must change some messages"
    if case == "1bit-inf":
        assert all(f"overlap-on/{case}/error/3" in results for results in ranks)


def test_binding_to_the_same_ranks_keeps_the_overlap_group(ranks: list[dict[str, Any]]) -> None:
    """DeepSpeed binds LionCub to its data-parallel group, the same ranks as the world: the overlap vote
    keeps the group made at construction (one communicator, not two) and still votes as without overlap."""
    for results in ranks:
        expected = 0 if len(ranks) == 1 else 1  # a world of one has nothing to overlap
        assert results["overlap-bind/groups-at-construction"] == expected
        assert results["overlap-bind/groups-after-bind"] == expected
        assert results["overlap-bind/same-step"] is True


def test_bf16_gradient_averaging_stays_close_to_fp32(ranks: list[dict[str, Any]]) -> None:
    for name in PARAM_NAMES:
        bf16 = ranks[0][f"train-param/none-bf16/{name}"]
        fp32 = ranks[0][f"train-param/none-fp32/{name}"]
        # Each step moves a coordinate by lr; a bf16-rounded gradient may flip a few signs.
        assert (bf16 - fp32).abs().max() <= 2 * sc.TRAIN_LR * sc.TRAIN_STEPS
        assert (bf16 == fp32).float().mean() > 0.9


def test_world_of_one_follows_single_process_lion(ranks: list[dict[str, Any]]) -> None:
    if len(ranks) != 1:
        pytest.skip("the plain Lion trajectory is the world-size-1 case")
    params = [t.clone() for t in sc.init_params().values()]
    momenta = [torch.zeros_like(t) for t in params]
    for step in range(1, sc.TRAIN_STEPS + 1):
        grads = sc.model_grads(params, 0, step)
        reference_lion_step(params, grads, momenta, sc.TRAIN_LR, sc.TRAIN_BETAS, sc.TRAIN_WEIGHT_DECAY)
    # With one worker, every sign-based mode is Lion (no exact zeros arise in c here).
    for mode in ("none-fp32", "1bit", "1bit-positive", "4bit-sign", "2bit-sign"):
        for index, name in enumerate(PARAM_NAMES):
            assert torch.equal(ranks[0][f"train-param/{mode}/{name}"], params[index]), f"{mode}: {name}"


def test_momentum_sync_equalises_selected_layers_on_sync_steps_only(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    if p == 1:
        pytest.skip("momentum is trivially equal on one rank")
    for step in range(1, sc.TRAIN_STEPS + 1):
        synced = step % sc.SYNC_INTERVAL == 0
        for name in PARAM_NAMES:
            key = f"train-exp-avg/1bit-sync/{step}/{name}"
            equal = all(torch.equal(results[key], ranks[0][key]) for results in ranks[1:])
            assert equal == (synced and name == "w2"), f"step {step} {name}: equal={equal}"


def test_collectives_per_step_are_bounded_by_buckets(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    total = sum(torch.Size(shape).numel() for shape in sc.PARAM_SHAPES.values())
    # At most one extra bucket per tensor boundary beyond ceil(total / bucket), 2 collectives each.
    bucket_bound = -(-total // sc.BUCKET_SIZE) + len(sc.PARAM_SHAPES)
    for step in range(1, sc.TRAIN_STEPS + 1):
        one_bit = ranks[0][f"train-stats/1bit/{step}"].collectives
        if p == 1:
            assert one_bit == 0
        else:  # 2 per bucket, plus the 4-byte finiteness check
            assert 2 * -(-total // sc.BUCKET_SIZE) + 1 <= one_bit <= 2 * bucket_bound + 1


def test_telemetry_records_each_steps_traffic(ranks: list[dict[str, Any]]) -> None:
    checks.telemetry_counts_the_traffic(ranks)


def test_telemetry_vote_rates_equal_brute_force(ranks: list[dict[str, Any]]) -> None:
    checks.telemetry_vote_rates_equal_brute_force(ranks)


def test_kbit_too_narrow_for_the_world_fails_at_construction(ranks: list[dict[str, Any]]) -> None:
    messages = {results["construct-error"] for results in ranks}
    assert len(messages) == 1
    message = messages.pop()
    if len(ranks) == 1:
        assert message is None  # 2-bit l1 holds exactly one worker
    else:
        assert "at most 1 workers" in message and "kbit_algorithm='alltoall'" in message


def test_nan_gradient_on_one_rank_stops_every_rank_before_any_change(ranks: list[dict[str, Any]]) -> None:
    p = len(ranks)
    messages = {results["nan-error"] for results in ranks}
    assert all(message is not None for message in messages)
    assert all(f"on 1 of {p} ranks at step 1" in message for message in messages)
    assert "'b1'" in ranks[-1]["nan-error"]
    for results in ranks:
        assert results["nan-unchanged"] and results["nan-no-state"]
