"""Compressed LionCub under ZeRO-1/2 as a hybrid (shard inside a node, vote across nodes), with the real launcher.

Two launches of 4 CPU ranks as 2 nodes x 2 (tests/workers/hybrid_scenarios.py): the main one trains every
scenario of tests.support.hybrid_cases, saves a checkpoint and builds every refused configuration; the
second resumes the checkpoint and tries to load it at other node sizes. The references are the plain-torch
simulation (tests.support.reference.simulate_hybrid, fed the partition geometry ZeRO reports), the stage-0
simulation, the uninterrupted run for the resume, WarmupLR's formula, and the layout of nodes and shards
(docs/design.md, section 12 (ZeRO-1/2 hybrid: shard inside a node, vote across nodes) and section 18
(exactness invariants)).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from ds_lioncub.comm import wire
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from tests.support.checks import same_message_on_every_rank
from tests.support.clip_reference import clipped_grads_fn
from tests.support.feedback_checks import assert_feedback_resume_bitwise, assert_rank_feedback_matches
from tests.support.hybrid_cases import (
    BETAS,
    BF16,
    BIAS_WEIGHT_DECAY,
    BINDING_CLIP,
    CHECKPOINT_AT,
    CHECKPOINTED,
    CHECKPOINTED_EF,
    CONSISTENCY_CHECKED,
    EF_CASES,
    FINITE_CHECK_ONLY,
    LR,
    NAN_RANK,
    NAN_STEP,
    NODE_SIZE,
    NODES,
    OPTION_CLIP_BF16,
    OTHER_TOPOLOGIES,
    REFUSED,
    STEPS,
    TRAINED_BY_NAME,
    WARMUP,
    WEIGHT_DECAY,
    WORLD,
    HybridCase,
    build_model,
    loss_of,
)
from tests.support.launch import REPO, ok_records, one_torch_thread, run_main_and_resume
from tests.support.reference import HybridRun, simulate_hybrid, simulate_lioncub

pytestmark = pytest.mark.deepspeed

WORKER = REPO / "tests" / "workers" / "hybrid_scenarios.py"
Records = list[dict[str, Any]]

# Scenarios whose every parameter, every step, must equal the simulation bit for bit.
BITWISE = [
    "zero1_1bit",
    "zero2_1bit",
    "zero2_kbit_sign_4bit_allreduce",
    "zero2_kbit_l1_8bit_alltoall",
    "zero1_kbit_l1_4bit_allreduce_mean",
    "zero2_1bit_positive_ties",
    "zero2_1bit_binding_clip",
    "zero2_1bit_nan_on_one_rank",
    "zero2_1bit_warmup_lr",
    "zero1_1bit_accumulation2",
    "zero2_1bit_accumulation2",
    "zero2_1bit_two_param_groups",
    "zero2_1bit_option_clip_two_param_groups",
    "zero1_kbit_l1_4bit_alltoall_default_clip",
    "zero2_1bit_option_clip_nan_on_one_rank",
    "zero2_1bit_default_clip_accumulation2",
    "zero2_1bit_momentum_sync_all",
    "zero2_1bit_node_size1",
    "zero2_1bit_node_size4",
    *(case.name for case in EF_CASES),
]
# Momenta also bitwise, except where the reduction order is not the simulation's: a clip coefficient from
# a norm summed in another order, or a node of 4 ranks whose sum order the collective library chooses.
MOMENTA_CLOSE = {"zero2_1bit_binding_clip", "zero2_1bit_node_size4"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> dict[str, Any]:
    return run_main_and_resume(WORKER, WORLD, tmp_path_factory.mktemp("zero_hybrid"), 600, 300)


# ---------------------------------------------------------------------------------------------- helpers


def _trained(launched: dict[str, Any], name: str) -> Records:
    return ok_records([results[f"trained/{name}"] for results in launched["main"]], name)


def _node(rank: int, node_size: int) -> int:
    return rank // node_size


def _local(rank: int, node_size: int) -> int:
    return rank % node_size


def _node_size(case: HybridCase) -> int:
    return case.node_size if case.node_size is not None else WORLD


def _gradients(case: HybridCase) -> Callable[[int, int, int, list[Tensor]], list[Tensor]]:
    """Rank ``rank``'s gradient of one micro-batch's loss at ``params``, computed here from the same inputs."""

    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        model = build_model()
        with torch.no_grad():
            for target, value in zip(model.parameters(), params, strict=True):
                target.copy_(value)
        with one_torch_thread(), torch.enable_grad():
            loss_of(model, rank, step, micro, case.nan_at).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    return grads


def _geometry(records: Records, case: HybridCase) -> tuple[list[list[int]], list[int]]:
    """(parameter indices per group, padding at the end of each padded flat group), as ZeRO reports them.

    Every rank must report the same groups and shard sizes; the padding at the end of a group is
    G x shard size - the group's elements, and it lies on the node's last rank.
    """
    geometries = [record["geometry"] for record in records]
    groups = geometries[0]["groups"]
    sizes = geometries[0]["partition_size"]
    numels = [p.numel() for p in build_model().parameters()]
    node_size = _node_size(case)
    paddings = []
    for i, group in enumerate(groups):
        padding = sizes[i] * node_size - sum(numels[p] for p in group)
        assert 0 <= padding < 2 * node_size, f"group {i}: padding {padding} beyond ZeRO's alignment 2G"
        paddings.append(padding)
    for rank, geometry in enumerate(geometries):
        assert geometry["groups"] == groups and geometry["partition_size"] == sizes, f"rank {rank}"
        assert geometry["partition_numel"] == sizes, f"rank {rank}"
        assert all(pad == 0 for pads in geometry["param_padding"] for pad in pads), "padding between parameters"
        last = _local(rank, node_size) == node_size - 1
        assert geometry["groups_padding"] == (paddings if last else [0] * len(groups)), f"rank {rank}"
    return groups, paddings


_SIMULATIONS: dict[str, HybridRun] = {}


def _simulate(records: Records, case: HybridCase, steps: int | None = None) -> HybridRun:
    """The simulation of ``case`` with the geometry the engine reported (cached per scenario)."""
    key = f"{case.name}/{steps}"
    if key in _SIMULATIONS:
        return _SIMULATIONS[key]
    groups, paddings = _geometry(records, case)
    node_size = _node_size(case)
    if case.scheduler is not None:
        engine_lr = records[0]["lr"]  # DeepSpeed's schedule, checked against its formula separately

        def lr(step: int) -> float:
            return engine_lr[step - 1]
    else:
        lr = LR  # type: ignore[assignment]
    decays = [WEIGHT_DECAY, BIAS_WEIGHT_DECAY] if case.bias_groups else [WEIGHT_DECAY]
    run = simulate_hybrid(
        [p.detach() for p in build_model().parameters()],
        _gradients(case),
        WORLD // node_size,
        node_size,
        steps if steps is not None else case.steps,
        groups_padding=paddings,
        param_groups=groups,
        gradient_accumulation_steps=case.accumulation,
        accumulate_after_reduce=case.stage == 2,
        gradient_clipping=case.simulated_clipping(),
        lr=lr,
        betas=BETAS,
        weight_decay=decays,
        **case.simulation_options(),
    )
    _SIMULATIONS[key] = run
    return run


def _first_difference(got: Tensor, expected: Tensor) -> str:
    differ = got != expected
    index = int(differ.reshape(-1).nonzero()[0])
    return (
        f"{int(differ.sum())} of {got.numel()} elements differ, max |diff| "
        f"{float((got - expected).abs().max()):.3g}; first at {index}: got {got.reshape(-1)[index].item()!r}, "
        f"expected {expected.reshape(-1)[index].item()!r}"
    )


def _assert_params_match(records: Records, run: HybridRun, what: str, first_step: int = 1) -> None:
    names = [name for name, _ in build_model().named_parameters()]
    for rank, record in enumerate(records):
        for offset, got_params in enumerate(record["params"]):
            step = first_step + offset
            for name, got, expected in zip(names, got_params, run.params_per_step[step - 1], strict=True):
                if not torch.equal(got, expected):
                    pytest.fail(f"{what}: rank {rank}, step {step}, {name}: {_first_difference(got, expected)}")


def _assert_shards_match(
    records: Records, run: HybridRun, node_size: int, what: str, key: str, close: bool = False
) -> None:
    """Rank (k, j) holds shard j of ``masters`` (``key`` "masters") or of node k's momentum ("momenta")."""
    for rank, record in enumerate(records):
        node, local = _node(rank, node_size), _local(rank, node_size)
        for i, got in enumerate(record[key]):
            vector = run.masters[i] if key == "masters" else run.momenta[node][i]
            expected = run.shard(vector, i, local)
            if close:
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9, msg=f"{what}: rank {rank} {key} {i}")
            elif not torch.equal(got, expected):
                pytest.fail(f"{what}: rank {rank}, {key} of group {i}: {_first_difference(got, expected)}")


# ---------------------------------------------------------------------------------------------- layout


def test_zero_partitions_inside_each_node_while_the_engine_keeps_the_world(launched: dict[str, Any]) -> None:
    for name in ("zero1_1bit", "zero2_1bit", "zero2_1bit_node_size1", "zero2_1bit_node_size4"):
        case = TRAINED_BY_NAME[name]
        node_size = _node_size(case)
        for rank, record in enumerate(_trained(launched, name)):
            geometry = record["geometry"]
            node = _node(rank, node_size)
            assert geometry["zero_group_ranks"] == list(range(node * node_size, (node + 1) * node_size)), name
            assert geometry["engine_dp_world_size"] == WORLD, name
        _geometry(_trained(launched, name), case)


def test_the_partition_is_padded_so_the_padding_is_exercised(launched: dict[str, Any]) -> None:
    records = _trained(launched, "zero2_1bit")
    _, paddings = _geometry(records, TRAINED_BY_NAME["zero2_1bit"])
    assert paddings == [1]  # 195 parameters padded to 196 = 2 shards of 98
    assert records[0]["geometry"]["partition_size"] == [98]


# ---------------------------------------------------------------------------------------------- against the simulation


@pytest.mark.parametrize("name", BITWISE)
def test_hybrid_parameters_match_the_simulation_bitwise_every_step_on_every_rank(
    launched: dict[str, Any], name: str
) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    _assert_params_match(records, _simulate(records, case), name)


@pytest.mark.parametrize("name", BITWISE)
def test_hybrid_shard_momenta_are_each_nodes_own_and_match_the_simulation(launched: dict[str, Any], name: str) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    node_size = _node_size(case)
    _assert_shards_match(records, _simulate(records, case), node_size, name, "momenta", close=name in MOMENTA_CLOSE)
    nodes = WORLD // node_size
    if nodes > 1 and "momentum_sync" not in case.options:
        for local in range(node_size):
            first, second = records[local]["momenta"][0], records[node_size + local]["momenta"][0]
            assert not torch.equal(first, second), f"{name}: nodes 0 and 1 hold the same momentum of shard {local}"


@pytest.mark.parametrize("name", BITWISE)
def test_hybrid_master_shards_match_the_simulation_padding_included(launched: dict[str, Any], name: str) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    _assert_shards_match(records, _simulate(records, case), _node_size(case), name, "masters")


@pytest.mark.parametrize("name", BITWISE)
def test_hybrid_lioncub_step_and_skipped_steps_match_the_simulation(launched: dict[str, Any], name: str) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    run = _simulate(records, case)
    for rank, record in enumerate(records):
        assert record["lioncub_step"] == run.lioncub_steps, f"{name}: rank {rank}"
        skipped = [sum(run.skipped[:step]) for step in range(1, case.steps + 1)]
        assert record["skipped_steps"] == skipped, f"{name}: rank {rank}"


def test_the_padding_moves_by_the_vote_but_is_never_a_parameter(launched: dict[str, Any]) -> None:
    """The padding's c is 0 on every node, so it takes the tie value each step: +-lr, identical everywhere."""
    records = _trained(launched, "zero2_1bit")
    last = [record["masters"][0][-1].item() for rank, record in enumerate(records) if rank % NODE_SIZE == 1]
    assert len(set(last)) == 1 and last[0] != 0.0
    run = _simulate(records, TRAINED_BY_NAME["zero2_1bit"])
    assert last[0] == run.masters[0][-1].item()
    assert sum(p.numel() for p in records[0]["params"][-1]) == 195


def test_nodes_vote_rather_than_average_one_world_gradient(launched: dict[str, Any]) -> None:
    """A control that the comparison is sensitive: one node of 4 (exact Lion over the world's average gradient,
    as the control run shows) differs from the 2 x 2 vote in many coordinates."""
    hybrid = _trained(launched, "zero2_1bit")[0]["params"][-1]
    exact = _trained(launched, "zero2_exact_control")[0]["params"][-1]
    differing = sum(int((a != b).sum()) for a, b in zip(hybrid, exact, strict=True))
    assert differing > 20


# ---------------------------------------------------------------------------------------------- controls


def test_control_deepspeed_exact_zero_matches_the_simulations_model_of_zero(launched: dict[str, Any]) -> None:
    """Without the hybrid (compression "none", ZeRO-2 over all 4 ranks): checks the simulation's ZeRO
    (reduction, padding, shards) and its gradients against DeepSpeed alone. Momenta only close: the
    collective library picks the order in which 4 ranks' gradients are summed."""
    for name in ("zero2_exact_control", "zero1_exact_control_accumulation2", "zero2_exact_control_accumulation2"):
        case = TRAINED_BY_NAME[name]
        records = _trained(launched, name)
        run = _simulate(records, case)
        _assert_params_match(records, run, name)
        _assert_shards_match(records, run, WORLD, name, "momenta", close=True)


def test_control_stage0_lioncub_matches_the_stage0_simulation(launched: dict[str, Any]) -> None:
    """Stage 0, every rank a voter: checks the gradients computed here against the engine's."""
    records = _trained(launched, "stage0_1bit")
    case = TRAINED_BY_NAME["stage0_1bit"]
    grads = _gradients(case)
    init = [p.detach() for p in build_model().parameters()]
    for steps in range(1, case.steps + 1):
        params, exp_avgs = simulate_lioncub(
            init, lambda r, t, ps: grads(r, t, 0, ps), WORLD, steps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
        for rank, record in enumerate(records):
            for got, expected in zip(record["params"][steps - 1], params, strict=True):
                assert torch.equal(got, expected), f"rank {rank}, step {steps}"
    for rank, record in enumerate(records):
        for got, expected in zip(record["momenta"], exp_avgs[rank], strict=True):
            assert torch.equal(got, expected), f"rank {rank}"


def test_stage0_option_clip_matches_the_plain_loop_every_step(launched: dict[str, Any]) -> None:
    """Stage 0 in fp32 (DeepSpeed's gradient_clipping 0): every rank's parameters and factors are those of the
    plain loop that clips the 4 ranks' gradients by the sketched norm of their mean (tests/support/clip_reference)."""
    case = TRAINED_BY_NAME["stage0_1bit_option_clip"]
    records = _trained(launched, case.name)
    grads = _gradients(case)
    factors: list[float] = []
    clip = case.options["clip"]
    clipped = clipped_grads_fn(
        lambda r, t, ps: grads(r, t, 0, ps), WORLD, clip["max_norm"], clip["sketch_bins"], factors
    )
    init = [p.detach() for p in build_model().parameters()]
    for steps in range(1, case.steps + 1):
        params, exp_avgs = simulate_lioncub(init, clipped, WORLD, steps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        for rank, record in enumerate(records):
            for got, expected in zip(record["params"][steps - 1], params, strict=True):
                assert torch.equal(got, expected), f"rank {rank}, step {steps}"
    assert any(f < 1.0 for f in factors) and any(f == 1.0 for f in factors), factors
    for rank, record in enumerate(records):
        assert record["clip_factor"] == pytest.approx(factors, rel=1e-12, abs=0), f"rank {rank}"
        for got, expected in zip(record["momenta"], exp_avgs[rank], strict=True):
            assert torch.equal(got, expected), f"rank {rank}"


@pytest.mark.parametrize("case", OPTION_CLIP_BF16, ids=lambda case: case.name)
def test_option_clip_under_bf16_keeps_every_rank_identical(launched: dict[str, Any], case: HybridCase) -> None:
    """The bf16 wrappers hand LionCub unscaled fp32 gradients: one factor on every rank, some steps clipped."""
    records = ok_records([results[f"trained/{case.name}"] for results in launched["main"]], case.name)
    factors = records[0]["clip_factor"]
    assert len(factors) == case.steps and any(f < 1.0 for f in factors), factors
    for rank, record in enumerate(records):
        assert record["clip_factor"] == factors, f"rank {rank}"
        for got, expected in zip(record["params"], records[0]["params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}"
    first, last = records[0]["params"][0], records[0]["params"][-1]
    assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True)), f"{case.name} did not train"


# ---------------------------------------------------------------------------------------------- invariants


def test_node_size_one_equals_stage0_compressed_lioncub_bitwise(launched: dict[str, Any]) -> None:
    """Every rank a node: ZeRO over one rank is no sharding, and the vote is stage 0's."""
    hybrid = _trained(launched, "zero2_1bit_node_size1")
    stage0 = _trained(launched, "stage0_1bit")
    for rank in range(WORLD):
        for step, (got, expected) in enumerate(zip(hybrid[rank]["params"], stage0[rank]["params"], strict=True), 1):
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b), f"rank {rank}, step {step}"
        flat = torch.cat([m.reshape(-1) for m in stage0[rank]["momenta"]])
        assert torch.equal(hybrid[rank]["momenta"][0][: flat.numel()], flat), f"rank {rank}"


def test_each_rank_keeps_one_node_size_th_of_the_momentum(launched: dict[str, Any]) -> None:
    numel = sum(p.numel() for p in build_model().parameters())
    stage0 = _trained(launched, "stage0_1bit")
    for record in stage0:
        assert record["exp_avg_numel"] == numel
    for name in ("zero1_1bit", "zero2_1bit", "zero2_1bit_node_size4"):
        node_size = _node_size(TRAINED_BY_NAME[name])
        for record in _trained(launched, name):
            # 1/G of stage 0's, rounded up to the shard size (ZeRO pads the group to a multiple of 2G)
            assert numel / node_size <= record["exp_avg_numel"] < numel / node_size + 2, name


def test_parameters_are_identical_on_every_rank_after_every_step(launched: dict[str, Any]) -> None:
    for name in BITWISE:
        records = _trained(launched, name)
        for record in records[1:]:
            for got, expected in zip(record["params"], records[0]["params"], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name


# ---------------------------------------------------------------------------------------------- clipping


def test_binding_clip_scales_each_node_by_its_own_norm(launched: dict[str, Any]) -> None:
    """Every rank reports its node's gradient norm (before clipping); the two nodes' norms differ."""
    case = TRAINED_BY_NAME["zero2_1bit_binding_clip"]
    records = _trained(launched, case.name)
    run = _simulate(records, case)
    for step in range(case.steps):
        norms = run.node_grad_norms[step]
        assert min(norms) > BINDING_CLIP, "the clip should bind on both nodes"
        assert norms[0] != pytest.approx(norms[1], rel=1e-3)
        for rank, record in enumerate(records):
            assert record["grad_norm"][step] == pytest.approx(norms[_node(rank, NODE_SIZE)], rel=1e-5), (
                f"rank {rank}, step {step + 1}"
            )


@pytest.mark.parametrize(
    "name", ["zero2_1bit_option_clip_two_param_groups", "zero1_kbit_l1_4bit_alltoall_default_clip"]
)
def test_option_clip_scales_every_node_by_the_sketched_norm_of_their_mean(launched: dict[str, Any], name: str) -> None:
    """Every rank applied the simulation's factor (the nodes' shards sketched and summed over the world) at every
    step; some steps clip and some do not, so the factor is not a constant."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    factors = _simulate(records, case).clip_factors
    assert len(factors) == case.steps and any(f < 1.0 for f in factors) and any(f == 1.0 for f in factors), factors
    for rank, record in enumerate(records):
        assert record["clip_factor"] == pytest.approx(factors, rel=1e-12, abs=0), f"rank {rank}"


# ---------------------------------------------------------------------------------------------- NaN


def test_a_nan_on_one_rank_skips_the_step_on_every_rank_of_every_node(launched: dict[str, Any]) -> None:
    case = TRAINED_BY_NAME["zero2_1bit_nan_on_one_rank"]
    assert case.nan_at == (NAN_RANK, NAN_STEP)
    records = _trained(launched, case.name)
    for rank, record in enumerate(records):
        assert record["skipped_steps"] == [0] * (NAN_STEP - 1) + [1] * (case.steps - NAN_STEP + 1), f"rank {rank}"
        assert record["lioncub_step"][NAN_STEP - 1] == NAN_STEP - 1, f"rank {rank}"
        before, at = record["params"][NAN_STEP - 2], record["params"][NAN_STEP - 1]
        assert all(torch.equal(a, b) for a, b in zip(before, at, strict=True)), f"rank {rank}: moved on the NaN step"
        assert all(bool(torch.isfinite(m).all()) for m in record["momenta"]), f"rank {rank}"


# ---------------------------------------------------------------------------------------------- schedules


def test_warmup_lr_is_applied_per_step_to_every_coordinate(launched: dict[str, Any]) -> None:
    case = TRAINED_BY_NAME["zero2_1bit_warmup_lr"]
    records = _trained(launched, case.name)
    lrs = records[0]["lr"]
    low, high, warmup = WARMUP["warmup_min_lr"], WARMUP["warmup_max_lr"], WARMUP["warmup_num_steps"]
    # DeepSpeed's linear WarmupLR: the first two steps at the minimum, then (step - 2) / warmup of the way up
    expected = [low] + [low + (high - low) * min(step - 2, warmup) / warmup for step in range(2, case.steps + 1)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    init = [p.detach() for p in build_model().parameters()]
    for step, params in enumerate(records[0]["params"], 1):
        previous = init if step == 1 else records[0]["params"][step - 2]
        lr = lrs[step - 1]
        for before, after in zip(previous, params, strict=True):
            moved = (before * (1 - lr * WEIGHT_DECAY) - after).abs()
            torch.testing.assert_close(moved, torch.full_like(moved, lr), rtol=1e-3, atol=1e-7)


# ---------------------------------------------------------------------------------------------- checkpoints


def _resumed(launched: dict[str, Any]) -> Records:
    return ok_records([results["resume"] for results in launched["resume"]], "resume")


def _real(shards: list[Tensor], record: dict[str, Any]) -> list[Tensor]:
    """A rank's shards without ZeRO's padding: DeepSpeed restores master shards with the padding reset to zero
    (it is no parameter, and its c is 0 whatever its value, so it never changes a vote or a parameter)."""
    geometry = record["geometry"]
    return [
        shard[: size - pad]
        for shard, size, pad in zip(shards, geometry["partition_size"], geometry["groups_padding"], strict=True)
    ]


def test_resume_after_save_equals_the_uninterrupted_run_bitwise_on_every_rank(launched: dict[str, Any]) -> None:
    """Parameters after every resumed step, each rank's shard of its node's momentum, the master shards and
    LionCub's step: all as if the run had not stopped."""
    ok_records([results["save"] for results in launched["main"]], "save")
    uninterrupted = _trained(launched, CHECKPOINTED.name)
    for rank, (record, reference) in enumerate(zip(_resumed(launched), uninterrupted, strict=True)):
        assert record["loaded_lioncub_step"] == CHECKPOINT_AT
        for step, (got, expected) in enumerate(
            zip(record["params"], reference["params"][CHECKPOINT_AT:], strict=True), CHECKPOINT_AT + 1
        ):
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b), f"rank {rank}, step {step}"
        for a, b in zip(record["momenta"], reference["momenta"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: momentum"
        for a, b in zip(_real(record["masters"], record), _real(reference["masters"], reference), strict=True):
            assert torch.equal(a, b), f"rank {rank}: master shard"
        assert record["lioncub_step"] == list(range(CHECKPOINT_AT + 1, STEPS + 1))


def test_resume_restores_each_ranks_own_shard_of_its_nodes_momentum(launched: dict[str, Any]) -> None:
    saved = ok_records([results["save"] for results in launched["main"]], "save")
    records = _resumed(launched)
    run = _simulate(saved, CHECKPOINTED, steps=CHECKPOINT_AT)
    _assert_shards_match(saved, run, NODE_SIZE, "saved", "momenta")
    for rank, (record, at_save) in enumerate(zip(records, saved, strict=True)):
        for a, b in zip(record["loaded_momenta"], at_save["momenta"], strict=True):
            assert torch.equal(a, b), f"rank {rank}"
        for a, b in zip(_real(record["loaded_masters"], at_save), _real(at_save["masters"], at_save), strict=True):
            assert torch.equal(a, b), f"rank {rank}"
    assert not torch.equal(records[0]["loaded_momenta"][0], records[NODE_SIZE]["loaded_momenta"][0])


def test_checkpoint_holds_one_lioncub_file_per_rank_and_deepspeed_files_from_node0(launched: dict[str, Any]) -> None:
    ok_records([results["save"] for results in launched["main"]], "save")
    checkpoint: Path = launched["checkpoint"]
    tag = (checkpoint / "latest").read_text().strip()
    files = sorted(path.name for path in (checkpoint / tag).iterdir())
    side = [name for name in files if "lioncub" in name]
    assert len(side) == WORLD, files
    optimizer_files = [name for name in files if name.endswith("optim_states.pt")]
    assert len(optimizer_files) == NODE_SIZE, files


@pytest.mark.parametrize("node_size", OTHER_TOPOLOGIES)
def test_loading_at_another_topology_is_refused_naming_both(launched: dict[str, Any], node_size: int) -> None:
    """The same message on every rank, naming the saved topology (2 nodes of 2) and the current one."""
    message = same_message_on_every_rank(launched["resume"], f"resume_at/{node_size}")
    assert message is not None, f"loading a {NODES} x {NODE_SIZE} checkpoint at node_size {node_size} was accepted"
    assert message.startswith("LionCub") or "LionCub: " in message, message
    assert "node" in message, message
    for count in (NODES, NODE_SIZE, WORLD // node_size, node_size):  # saved M and G, current M and G
        assert re.search(rf"\b{count}\b", message), f"{count} not named in {message!r}"


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_hybrid_configs_are_refused_identically_on_every_rank(launched: dict[str, Any], name: str) -> None:
    _, fragments = REFUSED[name]
    message = same_message_on_every_rank(launched["main"], f"refused/{name}")
    assert message is not None, f"{name} was accepted"
    assert "LionCub: " in message, message
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{name}: {fragment!r} not in {message!r}"


# ---------------------------------------------------------------------------------------------- traffic


def _expected_bytes_per_step(case: HybridCase, shard: int) -> int:
    """LionCub's bytes sent per rank per step (docs/design.md, section 14): the aggregation of one shard of
    ``shard`` elements over the M nodes, plus the 4-byte non-finite check, summed over the whole world so that
    every rank of every node reaches the same verdict: all-reduced inside the node (G ranks), then across the nodes."""
    node_size = _node_size(case)
    nodes = WORLD // node_size
    finite_check = 2 * (node_size - 1) * 4 // node_size + 2 * (nodes - 1) * 4 // nodes
    if nodes == 1:
        return finite_check  # a vote of one node communicates nothing, and one voter has no noise scale
    # The gradient noise scale (on by default): the default sketch's bins and the rank's squared norm, in fp64,
    # summed over the world in the same two levels.
    sketch = 8 * (DEFAULT_SKETCH_BINS + 1)
    finite_check += wire.all_reduce_bytes(sketch, node_size) + wire.all_reduce_bytes(sketch, nodes)
    if case.options["compression"] == "1bit":
        padded = 8 * nodes * math.ceil(shard / (8 * nodes))
        return 2 * (nodes - 1) * padded // (8 * nodes) + finite_check
    assert case.options.get("kbit_algorithm", "allreduce") == "allreduce"
    return 2 * (nodes - 1) * math.ceil(shard * case.options["bits"] / 8) // nodes + finite_check


@pytest.mark.parametrize(
    "name", ["zero2_1bit", "zero2_kbit_sign_4bit_allreduce", "zero2_1bit_node_size1", "zero2_1bit_node_size4"]
)
def test_lioncub_traffic_is_the_shards_vote_across_nodes_only(launched: dict[str, Any], name: str) -> None:
    """1 bit per shard element each way for a 1-bit vote of 2 nodes: 14 bytes for a shard of 98 (the full
    model's vote at stage 0 sends 42), plus the small sums every rank agrees on (the non-finite check, the noise
    scale's sketch), the same every step on every rank."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    expected = _expected_bytes_per_step(case, records[0]["geometry"]["partition_size"][0])
    for rank, record in enumerate(records):
        sent = [entry[1] for entry in record["comm"]]
        per_step = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert per_step == [expected] * case.steps, f"{name}: rank {rank}"


@pytest.mark.parametrize("name", BITWISE)
def test_each_steps_telemetry_is_its_traffic_and_marks_the_skipped_step(launched: dict[str, Any], name: str) -> None:
    """Per step: the record's traffic is the comm_stats() difference, a step ZeRO skipped (the NaN) is marked
    skipped with no traffic, and with vote_stats the ranks voting on the same shard (one per node) report
    one tie rate."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    node_size = _node_size(case)
    for rank, record in enumerate(records):
        telemetry = record["telemetry"]
        traffic = [(0, 0, 0), *record["comm"]]
        per_step = [
            tuple(b - a for a, b in zip(before, after, strict=True))
            for before, after in zip(traffic[:-1], traffic[1:], strict=True)
        ]
        assert [(t.collectives, t.bytes_sent, t.bytes_received) for t in telemetry] == per_step, f"{name}: rank {rank}"
        skipped = record["skipped_steps"]  # DeepSpeed's count after each step
        newly_skipped = [b - a for a, b in zip([0, *skipped[:-1]], skipped, strict=True)]
        assert [int(t.skipped) for t in telemetry] == newly_skipped, f"{name}: rank {rank}"
        assert [t.step for t in telemetry] == record["lioncub_step"], f"{name}: rank {rank}"
        measured = "telemetry" in case.options
        assert all((t.tie_rate is not None) == (measured and not t.skipped) for t in telemetry), f"{name}: rank {rank}"
    if "telemetry" in case.options:
        for rank, record in enumerate(records):
            peer = records[_local(rank, node_size)]  # node 0's rank with the same shard
            assert [t.tie_rate for t in record["telemetry"]] == [t.tie_rate for t in peer["telemetry"]], rank
        assert any(0 < (t.tie_rate or 0) < 1 for t in records[0]["telemetry"]), name


def test_node_size_one_sends_what_stage0_sends_but_its_finite_check(launched: dict[str, Any]) -> None:
    """The same votes and the same noise scale's sketch, but stage 0's sketch carries the non-finite verdict (one
    more fp64 number), where the hybrid, whose caller sketches before ZeRO's step, agrees on it by an int32 all-reduce
    of its own: one collective more a step, and those bytes against the 8."""
    hybrid = _trained(launched, "zero2_1bit_node_size1")
    stage0 = _trained(launched, "stage0_1bit")
    sketch = 8 * (DEFAULT_SKETCH_BINS + 1)  # the noise scale's bins and squared norm
    extra = (
        wire.all_reduce_bytes(4, WORLD)
        + wire.all_reduce_bytes(sketch, WORLD)
        - wire.all_reduce_bytes(sketch + 8, WORLD)
    )
    for rank in range(WORLD):
        for step, (got, want) in enumerate(zip(hybrid[rank]["comm"], stage0[rank]["comm"], strict=True), 1):
            expected = (want[0] + step, want[1] + step * extra, want[2] + step * extra)  # counts since the start
            assert tuple(got) == expected, f"rank {rank}, step {step}"


def test_steps_are_counted(launched: dict[str, Any]) -> None:
    """Sanity of the worker: every trained scenario recorded every step."""
    for name, case in TRAINED_BY_NAME.items():
        for record in _trained(launched, name):
            assert len(record["params"]) == case.steps and len(record["lr"]) == case.steps, name


# ---------------------------------------------------------------------------------- bf16, LionCub's own finite check


def test_bf16_hybrid_keeps_ranks_identical_and_skips_a_nan_step_everywhere(launched: dict[str, Any]) -> None:
    """bf16 (ZeRO's overflow check agreed across nodes): no simulation, but every rank identical every step."""
    case = BF16
    records = ok_records([results[f"trained/{case.name}"] for results in launched["main"]], case.name)
    for rank, record in enumerate(records):
        assert record["skipped_steps"] == [0] * (NAN_STEP - 1) + [1] * (case.steps - NAN_STEP + 1), f"rank {rank}"
        for got, expected in zip(record["params"], records[0]["params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}"
    first, last = records[0]["params"][0], records[0]["params"][-1]
    assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True)), "bf16 run did not train"


def test_with_deepspeeds_norm_check_off_lioncubs_check_stops_every_rank_of_every_node(launched: dict[str, Any]) -> None:
    """compute_grad_norm false: ZeRO skips nothing; LionCub's finite check, over the whole world, raises everywhere."""
    case = FINITE_CHECK_ONLY
    records = [results[f"trained/{case.name}"] for results in launched["main"]]
    assert all(record["error"] is not None for record in records), [record["error"] for record in records]
    # The same verdict everywhere; only the tail naming this rank's own offending parameters differs.
    verdicts = {record["error"].split(" (this rank's")[0] for record in records}
    assert len(verdicts) == 1, verdicts
    verdict = verdicts.pop()
    assert verdict.startswith("NonFiniteGradientError: LionCub: "), verdict
    # Rank 3's NaN enters its node's average, so both ranks of that node hold non-finite shard gradients.
    assert f"on {NODE_SIZE} of {WORLD} ranks at step {NAN_STEP}" in verdict, verdict
    for rank, record in enumerate(records):
        assert len(record["params"]) == NAN_STEP - 1, f"rank {rank} went past the NaN step"


def test_one_node_of_all_ranks_equals_zero2_exact_lion_bitwise(launched: dict[str, Any]) -> None:
    """G = N: one worker's vote is its own sign, so the hybrid is exact Lion under ZeRO-2 (no c is exactly 0 here)."""
    one_node = _trained(launched, "zero2_1bit_node_size4")
    exact = _trained(launched, "zero2_exact_control")
    for rank in range(WORLD):
        for step, (got, expected) in enumerate(zip(one_node[rank]["params"], exact[rank]["params"], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}, step {step + 1}"


# ------------------------------------------------------------------------------------------ ranks set up differently


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("options", ["option compression", "ranks 0, 2, 3: '1bit'", "rank 1: 'kbit'"]),
        ("model", ["parameter #0", "0.weight (16, 8)", "rank 1: 0.weight (12, 8)"]),
    ],
)
def test_a_rank_built_differently_stops_every_rank_before_deepspeeds_broadcast(
    launched: dict[str, Any], name: str, fragments: list[str]
) -> None:
    """Rank 1 alone has other LionCub options, or another model: the same error on every rank, naming it."""
    message = same_message_on_every_rank(launched["main"], f"mismatch/{name}")
    assert message is not None and message.startswith("LionCubConfigError: LionCub: the ranks"), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("case", CONSISTENCY_CHECKED, ids=lambda case: case.name)
def test_replica_checks_every_step_pass_on_shards_and_skip_partitions(
    launched: dict[str, Any], case: HybridCase
) -> None:
    records = ok_records([results[f"trained/{case.name}"] for results in launched["main"]], case.name)
    for record in records[1:]:
        for got, expected in zip(record["params"], records[0]["params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), case.name


@pytest.mark.parametrize(
    ("kind", "fragments"),
    [
        ("missing", ["incomplete", "saved by 4 ranks", "missing lioncub_hybrid_rank_00002.pt"]),
        ("truncated", ["lioncub_hybrid_rank_00003.pt is truncated or unreadable", "found by rank 3"]),
    ],
)
def test_a_damaged_hybrid_checkpoint_is_refused_on_every_rank(
    launched: dict[str, Any], kind: str, fragments: list[str]
) -> None:
    message = same_message_on_every_rank(launched["resume"], f"damaged/{kind}")
    assert message is not None and message.startswith("LionCubSetupError: LionCub: cannot resume from"), message
    for fragment in fragments:
        assert fragment in message, message


def test_a_shard_changed_on_one_rank_stops_every_rank_of_every_node(launched: dict[str, Any]) -> None:
    """Only rank 3's vote group holds the changed shard, but all 4 ranks raise together (none waits in ZeRO)."""
    message = same_message_on_every_rank(launched["main"], "perturbed")
    assert message is not None and message.startswith("LionCubSetupError: LionCub: the ranks' parameters differ"), (
        message
    )
    assert "after step 4" in message and "ZeRO shard" in message, message


# ---------------------------------------------------------------------------------------------- error feedback


def _feedback_buckets(record: dict[str, Any], what: str) -> dict[Any, dict[str, Tensor]]:
    state = record["aggregation"]
    assert state is not None, f"{what}: no error-feedback state"
    return state["buckets"]


@pytest.mark.parametrize("name", [case.name for case in EF_CASES])
def test_error_feedback_state_of_rank_k_j_is_node_ks_in_the_vote_on_shard_j(
    launched: dict[str, Any], name: str
) -> None:
    """Bit for bit against the simulation: rank (k, j)'s residuals (or EF21 estimates G_i) are worker k's of
    the vote on shard j, and its chunk of EF21's shared G is chunk k (the all-to-all over the M nodes)."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    run = _simulate(records, case)
    node_size = _node_size(case)
    kind = case.options["error_feedback"]["kind"]
    for rank, record in enumerate(records):
        node, local = _node(rank, node_size), _local(rank, node_size)
        what = f"{name}: rank {rank}"
        assert_rank_feedback_matches(record["aggregation"], run.feedback[local], node, WORLD // node_size, kind, what)


def test_each_rank_keeps_error_feedback_state_for_its_shard_only(launched: dict[str, Any]) -> None:
    """The residual or estimate of rank (k, j) covers its shards, 1/G of the model (stage 0 keeps all of it)."""
    numel = sum(p.numel() for p in build_model().parameters())
    for case in EF_CASES:
        node_size = _node_size(case)
        kind = "residual" if case.options["error_feedback"]["kind"] == "residual" else "estimate"
        for rank, record in enumerate(_trained(launched, case.name)):
            kept = sum(t[kind].numel() for t in _feedback_buckets(record, case.name).values())
            shard = sum(record["geometry"]["partition_size"])
            assert kept == shard, f"{case.name}: rank {rank}"
            groups = len(record["geometry"]["partition_size"])
            assert numel / node_size <= kept < numel / node_size + 2 * groups, f"{case.name}: rank {rank}"


def test_error_feedback_telemetry_reports_its_ratio_every_step_that_was_not_skipped(launched: dict[str, Any]) -> None:
    for case in EF_CASES:
        kind = case.options["error_feedback"]["kind"]
        for rank, record in enumerate(_trained(launched, case.name)):
            for t in record["telemetry"]:
                if t.skipped:
                    assert t.feedback_ratio is None, f"{case.name}: rank {rank}, step {t.step}"
                else:
                    assert t.feedback_kind == kind and t.feedback_ratio is not None, f"{case.name}: rank {rank}"
                    assert 0 < t.feedback_ratio < math.inf, f"{case.name}: rank {rank}, step {t.step}"


@pytest.mark.parametrize("case", CHECKPOINTED_EF, ids=lambda case: case.name)
def test_error_feedback_resume_equals_the_uninterrupted_run_bitwise(launched: dict[str, Any], case: HybridCase) -> None:
    """The state saved in each rank's side file comes back whole (the residual's reset clock too), and every
    resumed step's parameters, the final momenta and the final state are the uninterrupted run's."""
    saved = ok_records([results[f"save/{case.name}"] for results in launched["main"]], f"save/{case.name}")
    resumed = ok_records([results[f"resume/{case.name}"] for results in launched["resume"]], f"resume/{case.name}")
    assert_feedback_resume_bitwise(resumed, saved, _trained(launched, case.name), CHECKPOINT_AT + 1)
