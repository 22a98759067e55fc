"""Compressed LionCub under ZeRO-3 as a hybrid (stage 3 inside a node, vote across nodes), with the real launcher.

Two launches of 4 CPU ranks as 2 nodes x 2 (tests/workers/zero3_hybrid_scenarios.py): the main one trains every
scenario of tests.support.zero3_cases, saves a checkpoint and builds every refused configuration; the second
resumes the checkpoint and tries to load it at other topologies. The references: the plain-torch simulation
(tests.support.zero3_reference.simulate_hybrid_zero3), ZeRO-3's sub-group rule and slice sizes written here,
the uninterrupted run for the resume, DeepSpeed's own ZeRO-3 with exact Lion for G = N.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.support.checks import same_message_on_every_rank
from tests.support.feedback_checks import assert_feedback_resume_bitwise, assert_rank_feedback_matches
from tests.support.hybrid_cases import (
    BETAS,
    BIAS_WEIGHT_DECAY,
    BINDING_CLIP,
    CHECKPOINT_AT,
    LR,
    NAN_STEP,
    NODE_SIZE,
    NODES,
    OTHER_TOPOLOGIES,
    STEPS,
    WEIGHT_DECAY,
    WORLD,
    HybridCase,
    build_model,
    loss_of,
)
from tests.support.launch import REPO, ok_records, one_torch_thread, run_main_and_resume
from tests.support.zero3_cases import (
    BF16,
    CHECKPOINTED,
    CHECKPOINTED_EF,
    EF_CASES,
    REFUSED,
    SMALL_SUB_GROUP,
    TRAINED_BY_NAME,
    slice_sizes,
    sub_group_size_of,
    sub_groups,
)
from tests.support.zero3_reference import Zero3Run, simulate_hybrid_zero3

pytestmark = pytest.mark.deepspeed

WORKER = REPO / "tests" / "workers" / "zero3_hybrid_scenarios.py"
Records = list[dict[str, Any]]

# Every parameter, every step, bit for bit the simulation's on every rank.
BITWISE = [name for name in TRAINED_BY_NAME if name != "zero3_exact_control"]
# Momenta close, not bitwise: a clip coefficient from a norm summed in another order; a node of 4 ranks whose
# reduce-scatter sums in the collective library's order.
MOMENTA_CLOSE = {"zero3_1bit_binding_clip", "zero3_1bit_node_size4", "zero3_exact_control"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> dict[str, Any]:
    return run_main_and_resume(WORKER, WORLD, tmp_path_factory.mktemp("zero3_hybrid"), 900, 400)


# ---------------------------------------------------------------------------------------------- helpers


def _trained(launched: dict[str, Any], name: str) -> Records:
    return ok_records([results[f"trained/{name}"] for results in launched["main"]], name)


def _node_size(case: HybridCase) -> int:
    return case.node_size if case.node_size is not None else WORLD


def _gradients(case: HybridCase) -> Callable[[int, int, int, list[Tensor]], list[Tensor]]:
    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        model = build_model()
        with torch.no_grad():
            for target, value in zip(model.parameters(), params, strict=True):
                target.copy_(value)
        with one_torch_thread(), torch.enable_grad():
            loss_of(model, rank, step, micro, case.nan_at).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    return grads


def _expected_sub_groups(case: HybridCase) -> tuple[list[list[int]], list[int]]:
    """(sub-groups by parameter index, each one's param group) by ZeRO-3's rule, from the case alone."""
    numels = [p.numel() for p in build_model().parameters()]
    if case.bias_groups:
        param_groups = [[i for i in range(len(numels)) if i % 2 == 0], [i for i in range(len(numels)) if i % 2 == 1]]
    else:
        param_groups = [list(range(len(numels)))]
    groups, owners = [], []
    for g, members in enumerate(param_groups):
        for sub in sub_groups([numels[i] for i in members], _node_size(case), sub_group_size_of(case)):
            groups.append([members[i] for i in sub])
            owners.append(g)
    return groups, owners


_SIMULATIONS: dict[str, Zero3Run] = {}


def _simulate(records: Records, case: HybridCase, steps: int | None = None) -> Zero3Run:
    key = f"{case.name}/{steps}"
    if key in _SIMULATIONS:
        return _SIMULATIONS[key]
    groups, owners = _expected_sub_groups(case)
    node_size = _node_size(case)
    if case.scheduler is not None:
        engine_lr = records[0]["lr"]  # DeepSpeed's schedule; the ZeRO-1/2 hybrid's tests check its formula

        def lr(step: int) -> float:
            return engine_lr[step - 1]
    else:
        lr = LR  # type: ignore[assignment]
    decays = [WEIGHT_DECAY, BIAS_WEIGHT_DECAY] if case.bias_groups else [WEIGHT_DECAY]
    options = case.simulation_options()
    run = simulate_hybrid_zero3(
        [p.detach() for p in build_model().parameters()],
        _gradients(case),
        WORLD // node_size,
        node_size,
        steps if steps is not None else case.steps,
        sub_groups=groups,
        weight_decays=[decays[owner] for owner in owners],
        gradient_accumulation_steps=case.accumulation,
        gradient_clipping=case.simulated_clipping(),
        lr=lr,
        betas=BETAS,
        **options,
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


def _assert_params_match(records: Records, run: Zero3Run, what: str, first_step: int = 1) -> None:
    names = [name for name, _ in build_model().named_parameters()]
    for rank, record in enumerate(records):
        for offset, got_params in enumerate(record["params"]):
            step = first_step + offset
            for name, got, expected in zip(names, got_params, run.params_per_step[step - 1], strict=True):
                if not torch.equal(got, expected):
                    pytest.fail(f"{what}: rank {rank}, step {step}, {name}: {_first_difference(got, expected)}")


def _assert_flats_match(records: Records, run: Zero3Run, node_size: int, what: str, key: str, close: bool) -> None:
    """Rank (k, j) holds slice j of every sub-group: the masters, or node k's momentum."""
    for rank, record in enumerate(records):
        node, local = rank // node_size, rank % node_size
        for s, got in enumerate(record[key]):
            expected = run.masters[s][local] if key == "masters" else run.momenta[node][s][local]
            if close:
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9, msg=f"{what}: rank {rank} {key} {s}")
            elif not torch.equal(got, expected):
                pytest.fail(f"{what}: rank {rank}, {key} of sub-group {s}: {_first_difference(got, expected)}")


# ---------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("name", ["zero3_1bit", "zero3_1bit_sub_groups_two_param_groups", "zero3_1bit_node_size4"])
def test_zero3_partitions_every_parameter_inside_the_node_while_the_engine_keeps_the_world(
    launched: dict[str, Any], name: str
) -> None:
    """ZeRO-3's group and every parameter's partition group are the node; the sub-groups follow ZeRO-3's rule
    from the slice sizes ceil(numel / G), identically on every rank; LionCub holds no tensor between steps."""
    case = TRAINED_BY_NAME[name]
    node_size = _node_size(case)
    groups, owners = _expected_sub_groups(case)
    slices = slice_sizes(node_size)
    for rank, record in enumerate(_trained(launched, name)):
        geometry = record["geometry"]
        node = list(range(rank // node_size * node_size, (rank // node_size + 1) * node_size))
        assert geometry["zero_group_ranks"] == node, name
        assert geometry["param_group_ranks"] == [node] * len(slices), name
        assert geometry["engine_dp_world_size"] == WORLD, name
        assert geometry["slice_numel"] == slices, name
        assert geometry["sub_groups"] == groups and geometry["sub_group_param_group"] == owners, name
        assert geometry["flat_numel"] == [sum(slices[p] for p in group) for group in groups], name
        assert all(count == 0 for count in geometry["lioncub_param_groups_between_steps"]), name


def test_small_sub_group_size_gives_several_sub_groups_per_rank() -> None:
    """The scenarios named so step several flat tensors per optimizer step (a control on the cases)."""
    for name in ("zero3_1bit_sub_groups", "zero3_1bit_sub_groups_two_param_groups", "zero3_1bit_node_size4"):
        assert sub_group_size_of(TRAINED_BY_NAME[name]) == SMALL_SUB_GROUP
        assert len(_expected_sub_groups(TRAINED_BY_NAME[name])[0]) >= 2, name
    assert len(_expected_sub_groups(TRAINED_BY_NAME["zero3_1bit"])[0]) == 1


# ---------------------------------------------------------------------------------------------- against the simulation


@pytest.mark.parametrize("name", BITWISE)
def test_zero3_hybrid_parameters_match_the_simulation_bitwise_every_step_on_every_rank(
    launched: dict[str, Any], name: str
) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    _assert_params_match(records, _simulate(records, case), name)


@pytest.mark.parametrize("name", [*BITWISE, "zero3_exact_control"])
def test_zero3_masters_and_each_nodes_momenta_match_the_simulation(launched: dict[str, Any], name: str) -> None:
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    run = _simulate(records, case)
    node_size = _node_size(case)
    _assert_flats_match(records, run, node_size, name, "masters", close=False)
    _assert_flats_match(records, run, node_size, name, "momenta", close=name in MOMENTA_CLOSE)
    if WORLD // node_size > 1 and "momentum_sync" not in case.options:
        first, second = records[0]["momenta"][0], records[node_size]["momenta"][0]
        assert not torch.equal(first, second), f"{name}: nodes 0 and 1 hold the same momentum"


@pytest.mark.parametrize("name", BITWISE)
def test_lioncub_counts_optimizer_steps_not_sub_group_calls(launched: dict[str, Any], name: str) -> None:
    """LionCub's step after each engine step is the simulation's (one per step taken, whatever the sub-groups),
    DeepSpeed's skipped steps too, and each engine step makes one telemetry record at that step."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    run = _simulate(records, case)
    skipped = [sum(run.skipped[:step]) for step in range(1, case.steps + 1)]
    for rank, record in enumerate(records):
        assert record["lioncub_step"] == run.lioncub_steps, f"{name}: rank {rank}"
        assert record["skipped_steps"] == skipped, f"{name}: rank {rank}"
        telemetry = record["telemetry"]
        assert [t.step for t in telemetry] == run.lioncub_steps, f"{name}: rank {rank}"
        assert [t.skipped for t in telemetry] == run.skipped, f"{name}: rank {rank}"
        traffic = [(0, 0, 0), *record["comm"]]
        per_step = [tuple(b - a for a, b in zip(x, y, strict=True)) for x, y in zip(traffic, traffic[1:], strict=False)]
        assert [(t.collectives, t.bytes_sent, t.bytes_received) for t in telemetry] == per_step, f"{name}: {rank}"


def test_the_exact_control_is_deepspeeds_zero3_and_matches_the_simulation(launched: dict[str, Any]) -> None:
    """Without the hybrid (compression "none", ZeRO-3 over the 4 ranks, several sub-groups): checks the
    simulation's model of ZeRO-3 (slices, padding, sub-groups, reduction) against DeepSpeed alone."""
    case = TRAINED_BY_NAME["zero3_exact_control"]
    records = _trained(launched, case.name)
    assert records[0]["geometry"]["zero_class"] == "HybridZeroStage3"  # the sub-group bracket, no hybrid
    _assert_params_match(records, _simulate(records, case), case.name)


def test_one_node_of_all_ranks_equals_zero3_exact_lion_bitwise(launched: dict[str, Any]) -> None:
    """G = N: one node's vote is its own sign, so the hybrid is DeepSpeed's ZeRO-3 with exact Lion."""
    one_node = _trained(launched, "zero3_1bit_node_size4")
    exact = _trained(launched, "zero3_exact_control")
    for rank in range(WORLD):
        for step, (got, expected) in enumerate(zip(one_node[rank]["params"], exact[rank]["params"], strict=True), 1):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}, step {step}"


def test_nodes_vote_rather_than_average_one_world_gradient(launched: dict[str, Any]) -> None:
    """A control that the comparison is sensitive: 2 x 2 differs from one node of 4 in many coordinates."""
    hybrid = _trained(launched, "zero3_1bit_sub_groups")[0]["params"][-1]
    exact = _trained(launched, "zero3_exact_control")[0]["params"][-1]
    assert sum(int((a != b).sum()) for a, b in zip(hybrid, exact, strict=True)) > 20


def test_each_rank_keeps_one_node_size_th_of_stage0s_optimizer_state(launched: dict[str, Any]) -> None:
    """Stage 0 keeps one momentum element per parameter element (195); a ZeRO-3 hybrid rank keeps its slices,
    ceil(numel / G) per parameter: 1/G of that, up to the padding of slices that do not divide."""
    numel = sum(p.numel() for p in build_model().parameters())
    for name in ("zero3_1bit", "zero3_1bit_sub_groups", "zero3_1bit_node_size4"):
        node_size = _node_size(TRAINED_BY_NAME[name])
        for record in _trained(launched, name):
            assert record["exp_avg_numel"] == sum(slice_sizes(node_size)), name
            assert numel / node_size <= record["exp_avg_numel"] < numel / node_size + len(slice_sizes(node_size))
            assert len([m for m in record["momenta"] if m is not None]) == len(record["masters"]), name


# ---------------------------------------------------------------------------------------------- NaN, clip, bf16


@pytest.mark.parametrize("name", ["zero3_1bit_nan_on_one_rank", BF16.name])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_of_every_node(launched: dict[str, Any], name: str) -> None:
    """fp32 and bf16 (ZeRO-3 skips on an invalid gradient norm, agreed across nodes): every rank skips the NaN
    step together, nothing moves on it, and the ranks stay identical (no hang: the launch finished)."""
    records = ok_records([results[f"trained/{name}"] for results in launched["main"]], name)
    for rank, record in enumerate(records):
        assert record["skipped_steps"] == [0] * (NAN_STEP - 1) + [1] * (STEPS - NAN_STEP + 1), f"rank {rank}"
        assert record["lioncub_step"][NAN_STEP - 1] == NAN_STEP - 1, f"rank {rank}"
        before, at = record["params"][NAN_STEP - 2], record["params"][NAN_STEP - 1]
        assert all(torch.equal(a, b) for a, b in zip(before, at, strict=True)), f"rank {rank}: moved on the NaN step"
        for got, expected in zip(record["params"], records[0]["params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), f"rank {rank}"
    first, last = records[0]["params"][0], records[0]["params"][-1]
    assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True)), f"{name} did not train"


def test_binding_clip_scales_each_node_by_its_own_norm(launched: dict[str, Any]) -> None:
    """Each rank reports its node's gradient norm, the norm of the simulation's node gradient (before clipping)."""
    case = TRAINED_BY_NAME["zero3_1bit_binding_clip"]
    records = _trained(launched, case.name)
    grads = _gradients(case)
    run = _simulate(records, case)
    for step in range(1, case.steps + 1):
        params = run.params_per_step[step - 2] if step > 1 else [p.detach() for p in build_model().parameters()]
        norms = []
        for node in range(NODES):
            ranks = range(node * NODE_SIZE, (node + 1) * NODE_SIZE)
            per_rank = [grads(rank, step, 0, [p.clone() for p in params]) for rank in ranks]
            node_grad = [sum(g[i] / NODE_SIZE for g in per_rank) for i in range(len(params))]
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in node_grad]))))
        assert min(norms) > BINDING_CLIP and norms[0] != pytest.approx(norms[1], rel=1e-3)
        for rank, record in enumerate(records):
            assert record["grad_norm"][step - 1] == pytest.approx(norms[rank // NODE_SIZE], rel=1e-5), (rank, step)


# ---------------------------------------------------------------------------------------------- checkpoints


def test_option_clip_gives_every_sub_group_the_factor_of_the_whole_step(launched: dict[str, Any]) -> None:
    """Three step() calls per optimizer step, one factor: the simulation's, from every sub-group's flat tensor on
    every node; some steps clip and some do not."""
    case = TRAINED_BY_NAME["zero3_1bit_option_clip_sub_groups"]
    records = _trained(launched, case.name)
    factors = _simulate(records, case).clip_factors
    assert len(factors) == case.steps and any(f < 1.0 for f in factors) and any(f == 1.0 for f in factors), factors
    for rank, record in enumerate(records):
        assert record["clip_factor"] == pytest.approx(factors, rel=1e-12, abs=0), f"rank {rank}"


def _resumed(launched: dict[str, Any]) -> Records:
    return ok_records([results["resume"] for results in launched["resume"]], "resume")


def test_resume_in_a_new_job_equals_the_uninterrupted_run_bitwise_on_every_rank(launched: dict[str, Any]) -> None:
    """Parameters after every resumed step, each rank's flat masters and its node's momenta, LionCub's step:
    as the simulation of the uninterrupted run says (several sub-groups, two nodes with their own momenta)."""
    saved = ok_records([results["save"] for results in launched["main"]], "save")
    records = _resumed(launched)
    run = _simulate(records, CHECKPOINTED)
    _assert_flats_match(saved, _simulate(saved, CHECKPOINTED, CHECKPOINT_AT), NODE_SIZE, "saved", "momenta", False)
    for rank, (record, at_save) in enumerate(zip(records, saved, strict=True)):
        assert record["loaded_lioncub_step"] == CHECKPOINT_AT
        for a, b in zip(record["loaded_momenta"], at_save["momenta"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: loaded momentum"
        assert record["lioncub_step"] == list(range(CHECKPOINT_AT + 1, STEPS + 1))
    _assert_params_match(records, run, "resumed", first_step=CHECKPOINT_AT + 1)
    _assert_flats_match(records, run, NODE_SIZE, "resumed", "masters", close=False)
    _assert_flats_match(records, run, NODE_SIZE, "resumed", "momenta", close=False)
    assert not torch.equal(records[0]["loaded_momenta"][0], records[NODE_SIZE]["loaded_momenta"][0])


def test_checkpoint_holds_a_side_file_per_rank_and_deepspeeds_files_from_node0_only(launched: dict[str, Any]) -> None:
    """ZeRO-3 names model and optimizer files by rank in the node; node 0 alone writes them (no collision)."""
    ok_records([results["save"] for results in launched["main"]], "save")
    checkpoint: Path = launched["checkpoint"]
    tag = (checkpoint / "latest").read_text().strip()
    files = sorted(path.name for path in (checkpoint / tag).iterdir())
    assert [name for name in files if "lioncub" in name] == [f"lioncub_hybrid_rank_{r:05d}.pt" for r in range(WORLD)]
    for kind in ("model_states", "optim_states"):
        written = [name for name in files if name.endswith(f"{kind}.pt")]
        assert written == [f"zero_pp_rank_{j}_mp_rank_00_{kind}.pt" for j in range(NODE_SIZE)], files


@pytest.mark.parametrize("label", [*(f"node_size{size}" for size in OTHER_TOPOLOGIES), "zero2"])
def test_loading_at_another_topology_is_refused_before_deepspeed_reads_it(launched: dict[str, Any], label: str) -> None:
    message = same_message_on_every_rank(launched["resume"], f"resume_at/{label}")
    assert message.startswith("LionCubSetupError: LionCub: cannot resume from"), message
    assert "Nothing was loaded" in message, message
    if label == "zero2":
        assert "ZeRO-3 hybrid" in message and "ZeRO-1/2 hybrid" in message, message
    else:
        node_size = int(label.removeprefix("node_size"))
        for count in (NODES, NODE_SIZE, WORLD // node_size, node_size):
            assert re.search(rf"\b{count}\b", message), f"{count} not named in {message!r}"


def test_a_checkpoint_missing_a_side_file_is_refused_on_every_rank(launched: dict[str, Any]) -> None:
    message = same_message_on_every_rank(launched["resume"], "damaged/missing")
    assert message.startswith("LionCubSetupError: LionCub: cannot resume from"), message
    assert "missing lioncub_hybrid_rank_00002.pt" in message, message


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_zero3_hybrid_configs_are_refused_identically_on_every_rank(
    launched: dict[str, Any], name: str
) -> None:
    _, fragments = REFUSED[name]
    message = same_message_on_every_rank(launched["main"], f"refused/{name}")
    assert "LionCub: " in message, message
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{name}: {fragment!r} not in {message!r}"


def test_steps_are_counted(launched: dict[str, Any]) -> None:
    for name, case in TRAINED_BY_NAME.items():
        for record in _trained(launched, name):
            assert len(record["params"]) == case.steps == STEPS and len(record["lr"]) == case.steps, name


# ---------------------------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", [case.name for case in EF_CASES])
def test_error_feedback_state_of_each_sub_group_is_its_own_and_the_simulations(
    launched: dict[str, Any], name: str
) -> None:
    """Rank (k, j) keeps one state per sub-group (bucket key (s, 0): ZeRO-3 steps each in its own call), bit for
    bit worker k's of the simulated vote on slice j; together they cover its slices, 1/G of the model."""
    case = TRAINED_BY_NAME[name]
    records = _trained(launched, name)
    run = _simulate(records, case)
    node_size = _node_size(case)
    kind = case.options["error_feedback"]["kind"]
    groups, _ = _expected_sub_groups(case)
    for rank, record in enumerate(records):
        node, local = rank // node_size, rank % node_size
        what = f"{name}: rank {rank}"
        assert_rank_feedback_matches(record["aggregation"], run.feedback[local], node, WORLD // node_size, kind, what)
        buckets = record["aggregation"]["buckets"]
        assert sorted(buckets) == [(s, 0) for s in range(len(groups))], what
        kept = sum(t["residual" if kind == "residual" else "estimate"].numel() for t in buckets.values())
        assert kept == sum(slice_sizes(node_size)), what


def test_error_feedback_resume_in_a_new_job_equals_the_uninterrupted_run_bitwise(launched: dict[str, Any]) -> None:
    """The residuals of every sub-group come back from each rank's side file with their reset clock, and the
    resumed steps, the final momenta and the final residuals are the uninterrupted run's."""
    saved = ok_records([results["save/ef"] for results in launched["main"]], "save/ef")
    resumed = ok_records([results["resume/ef"] for results in launched["resume"]], "resume/ef")
    assert_feedback_resume_bitwise(resumed, saved, _trained(launched, CHECKPOINTED_EF.name), CHECKPOINT_AT + 1)
