"""The Hugging Face Trainer with a ds_config whose optimizer is compressed LionCub under the ZeRO-3 hybrid (and the
ZeRO-2 hybrid), with the real launcher: one launch of 4 CPU ranks as 2 nodes x 2
(tests/workers/hf_trainer_scenarios.py).

The references: the plain-torch simulations (tests.support.zero3_reference.simulate_hybrid_zero3 for stage 3,
tests.support.reference.simulate_hybrid for stage 2) fed with each rank's gradient recomputed here from the batch the
Trainer gave it, the Trainer's default schedule (linear decay, no warm-up) written from its definition, ZeRO-3's
slice sizes, the node-major groups, and the loss on held-out sequences before and after training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("transformers", reason="the Trainer test needs transformers (pip install -e '.[test]')")

from tests.support.checks import same_message_on_every_rank  # noqa: E402 - after the skip
from tests.support.hf_cases import (  # noqa: E402
    BETAS,
    CASES,
    EXAMPLES,
    HELD_OUT,
    MICRO_BATCH,
    NODE_SIZE,
    NODES,
    SEQUENCE,
    STEPS,
    WEIGHT_DECAY,
    WORLD,
    ZERO2,
    ZERO3,
    CountingDataset,
    HfCase,
    build_model,
    linear_lr,
    sequences,
)
from tests.support.launch import REPO, one_torch_thread, run_deepspeed  # noqa: E402
from tests.support.reference import simulate_hybrid  # noqa: E402
from tests.support.zero3_reference import simulate_hybrid_zero3  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

WORKER = REPO / "tests" / "workers" / "hf_trainer_scenarios.py"
Records = list[dict[str, Any]]
BY_NAME = {case.name: case for case in CASES}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, packing_op_build: tuple[Any, Any]) -> Records:
    out = tmp_path_factory.mktemp("hf_trainer")
    files = [out / f"rank{rank}.pt" for rank in range(WORLD)]
    run_deepspeed(WORKER, WORLD, ["--out", str(out)], files, timeout_s=600)
    return [torch.load(path, weights_only=False) for path in files]


def _trained(launched: Records, name: str) -> Records:
    records = [results[name] for results in launched]
    for rank, record in enumerate(records):
        if record["error"] is not None:
            pytest.fail(f"{name} raised on rank {rank}: {record['error']}\n{record.get('traceback', '')[-3000:]}")
    return records


def _gradients(records: Records) -> Callable[[int, int, int, list[Tensor]], list[Tensor]]:
    """Rank ``rank``'s gradient at step ``step``: the model at ``params`` called with the keyword arguments the
    Trainer passed on that rank at that step (its batch, ``num_items_in_batch``), its loss backpropagated."""
    model = build_model()
    model.train()  # as the Trainer runs it (no dropout in this model: the mode changes nothing else)

    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        assert micro == 0
        with torch.no_grad():
            for target, value in zip(model.parameters(), params, strict=True):
                target.copy_(value)
        model.zero_grad(set_to_none=True)
        with one_torch_thread(), torch.enable_grad():
            model(**records[rank]["calls"][step - 1]).loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    return grads


_SIMULATIONS: dict[str, list[list[Tensor]]] = {}


def _simulated_params(records: Records, case: HfCase) -> list[list[Tensor]]:
    """The parameters after each step, as the simulation of the case's ZeRO stage says."""
    if case.name in _SIMULATIONS:
        return _SIMULATIONS[case.name]
    init = [p.detach() for p in build_model().parameters()]
    common: dict[str, Any] = {"lr": linear_lr, "betas": BETAS, "compression": case.compression}
    if case.stage == 3:
        # One param group (the Trainer hands DeepSpeed a plain parameter list), ZeRO-3's default sub-group
        # size: one sub-group of every parameter.
        run = simulate_hybrid_zero3(
            init,
            _gradients(records),
            NODES,
            NODE_SIZE,
            STEPS,
            sub_groups=[list(range(len(init)))],
            weight_decays=[WEIGHT_DECAY],
            **common,
        )
        params = run.params_per_step
    else:
        # 920 elements split into 2 shards of 460: ZeRO-2 pads nothing.
        assert sum(p.numel() for p in init) % NODE_SIZE == 0
        hybrid = simulate_hybrid(
            init,
            _gradients(records),
            NODES,
            NODE_SIZE,
            STEPS,
            groups_padding=[0],
            weight_decay=WEIGHT_DECAY,
            **common,
        )
        params = hybrid.params_per_step
    _SIMULATIONS[case.name] = params
    return params


def _held_out_loss(params: list[Tensor]) -> float:
    model = build_model()
    with torch.no_grad():
        for target, value in zip(model.parameters(), params, strict=True):
            target.copy_(value)
        tokens = sequences(HELD_OUT, seed=2)
        return float(model(input_ids=tokens, labels=tokens).loss)


# ---------------------------------------------------------------------------------------------- what the Trainer built


@pytest.mark.parametrize("name", [ZERO3.name, ZERO2.name])
def test_the_trainer_builds_lioncub_in_the_zero_hybrid_from_the_ds_config(launched: Records, name: str) -> None:
    """The engine the Trainer made runs LionCub (from the ds_config's "optimizer" block, the Trainer's "auto"
    values filled in) inside the hybrid's ZeRO class; ZeRO's group is the node, LionCub votes over one rank per
    node; the Trainer counts the 4 ranks."""
    case = BY_NAME[name]
    for rank, record in enumerate(_trained(launched, name)):
        node, local = divmod(rank, NODE_SIZE)
        node_ranks = list(range(node * NODE_SIZE, (node + 1) * NODE_SIZE))
        assert record["engine_class"] == "DeepSpeedEngine", rank
        assert record["zero_stage"] == case.stage, rank
        assert record["zero_class"] == ("HybridZeroStage3" if case.stage == 3 else "HybridZeroOptimizer"), rank
        assert record["lioncub_class"] == "LionCub" and record["compression"] == "1bit", rank
        assert record["transport_world_size"] == NODES and record["transport_rank"] == node, rank
        assert record["vote_group_ranks"] == [k * NODE_SIZE + local for k in range(NODES)], rank
        assert record["zero_group_ranks"] == node_ranks, rank
        assert record["engine_dp_world_size"] == WORLD, rank
        assert record["world_size_seen_by_trainer"] == WORLD and record["process_index_seen_by_trainer"] == rank
        assert record["lioncub_weight_decay"] == [WEIGHT_DECAY] and record["lioncub_betas"] == [BETAS], rank
        if case.stage == 3:
            assert record["param_group_ranks"] == [node_ranks] * len(record["slice_numel"]), rank


def test_the_trainer_gives_each_rank_its_own_batches_and_every_example_once(launched: Records) -> None:
    """Data parallel over the world (not over a node): the ranks' batches over the run are the data set."""
    for name in (ZERO3.name, ZERO2.name):
        records = _trained(launched, name)
        seen = []
        for record in records:
            assert len(record["calls"]) == STEPS, name
            for call in record["calls"]:
                assert call["input_ids"].shape == (MICRO_BATCH, SEQUENCE), name
                assert torch.equal(call["input_ids"], call["labels"]), name
                seen.append(call["input_ids"])
        rows = sorted(tuple(row.tolist()) for row in torch.cat(seen))
        expected = sorted(tuple(row.tolist()) for row in CountingDataset().tokens)
        assert len(rows) == EXAMPLES and rows == expected, name


# ---------------------------------------------------------------------------------------------- against the simulation


@pytest.mark.parametrize("name", [ZERO3.name, ZERO2.name])
def test_trainer_parameters_are_identical_on_every_rank_and_equal_the_simulation_every_step(
    launched: Records, name: str
) -> None:
    """The gathered parameters after every Trainer step, on every rank, bit for bit the simulation's: the vote
    across nodes, ZeRO's reduction inside the node, the Trainer's lr schedule applied to LionCub."""
    case = BY_NAME[name]
    records = _trained(launched, name)
    names = [n for n, _ in build_model().named_parameters()]
    for rank, record in enumerate(records):
        assert all(torch.equal(a, b) for a, b in zip(record["initial"], build_model().parameters(), strict=True))
        assert record["lioncub_step"] == list(range(1, STEPS + 1)) and record["skipped_steps"] == [0] * STEPS
        assert record["global_step"] == list(range(1, STEPS + 1)), rank
    expected = _simulated_params(records, case)
    for rank, record in enumerate(records):
        assert len(record["params"]) == STEPS, rank
        for step, (got_params, want_params) in enumerate(zip(record["params"], expected, strict=True), 1):
            for param_name, got, want in zip(names, got_params, want_params, strict=True):
                if not torch.equal(got, want):
                    diff = float((got - want).abs().max())
                    pytest.fail(f"{name}: rank {rank}, step {step}, {param_name}: max |diff| {diff:.3g}")


def test_the_comparison_sees_the_schedule_and_the_vote(launched: Records) -> None:
    """Controls on the reference: the lr decays over the run, the ranks' gradients differ, and the
    parameters move at every step (a constant lr or one averaged gradient would not match bitwise)."""
    records = _trained(launched, ZERO3.name)
    assert linear_lr(1) > linear_lr(STEPS) > 0
    grads = _gradients(records)
    init = [p.detach() for p in build_model().parameters()]
    first = [grads(rank, 1, 0, [p.clone() for p in init]) for rank in range(WORLD)]
    assert not all(torch.equal(a, b) for a, b in zip(first[0], first[NODE_SIZE], strict=True))
    previous = init
    for params in records[0]["params"]:
        assert any(not torch.equal(a, b) for a, b in zip(previous, params, strict=True))
        previous = params


# ---------------------------------------------------------------------------------------------- state and loss


def test_each_rank_keeps_one_node_size_th_of_the_optimizer_state(launched: Records) -> None:
    """Stage 0 keeps one momentum element per parameter element (920); a ZeRO-3 hybrid rank keeps its slice,
    ceil(numel / G) per parameter (ZeRO-2: its shard of the flat group), in LionCub's ``exp_avg``."""
    numels = [p.numel() for p in build_model().parameters()]
    slices = [math.ceil(numel / NODE_SIZE) for numel in numels]
    for rank, record in enumerate(_trained(launched, ZERO3.name)):
        assert record["slice_numel"] == slices, rank
        assert record["exp_avg_numel"] == sum(slices) == sum(numels) // NODE_SIZE, rank
    for rank, record in enumerate(_trained(launched, ZERO2.name)):
        assert record["exp_avg_numel"] == sum(numels) // NODE_SIZE, rank


def test_the_loss_goes_down(launched: Records) -> None:
    """On held-out sequences the trained parameters beat the initial ones clearly, and the Trainer's logged
    training loss (its mean over the ranks) falls from the first step to the last."""
    for name in (ZERO3.name, ZERO2.name):
        record = _trained(launched, name)[0]
        before = _held_out_loss([p.detach() for p in build_model().parameters()])
        after = _held_out_loss(record["params"][-1])
        assert after < 0.85 * before, (name, before, after)
        logged = [entry["loss"] for entry in record["log_history"] if "loss" in entry]
        assert len(logged) == STEPS and logged[-1] < 0.85 * logged[0], (name, logged)


# ---------------------------------------------------------------------------------------------- refused


def test_a_model_built_under_the_trainers_zero_init_is_refused_on_every_rank(launched: Records) -> None:
    """The HF docs' ZeRO-3 order (TrainingArguments first, then ``from_config``/``from_pretrained``) builds the
    model under DeepSpeed's zero.Init, partitioned over the whole world: the hybrid refuses it and says how."""
    message = same_message_on_every_rank(launched, "refused/partitioned_by_hf_from_config")
    assert message.startswith("LionCubConfigError: LionCub: the model was already partitioned"), message
    assert "over 4 ranks" in message and "Build the model without deepspeed.zero.Init" in message, message
