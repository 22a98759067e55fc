"""Checks of tests.support.reference.simulate_hybrid (compressed LionCub under ZeRO-1/2 as a hybrid) by hand and
against the stage-0 simulation, so that the launcher tests compare the library with a trusted reference."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.support.error_feedback_reference import simulate_ef
from tests.support.reference import reference_lion_step, simulate_hybrid, simulate_lioncub

T = torch.tensor

# Hand-worked 2 nodes x 2 ranks, one parameter of 3 elements, 1 padding element: flat [x0, x1, x2, pad],
# shard 0 = [x0, x1], shard 1 = [x2, pad]. Step 1 gradients (rank order); step 2 gradients are zero.
HAND_GRADS = [T([2.0, -2.0, 4.0]), T([0.0, -2.0, -4.0]), T([-2.0, 2.0, 2.0]), T([-2.0, 2.0, 2.0])]
HAND = dict(groups_padding=[1], lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)


def _hand_grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
    return [HAND_GRADS[rank] if step == 1 else torch.zeros(3)]


def test_hand_worked_two_nodes_of_two_1bit() -> None:
    # Node gradients (g/2 summed): node 0 [1, -2, 0], node 1 [-2, 2, 2]; with m = 0, c = g/2:
    # node 0 c = [.5, -1, 0, 0], node 1 c = [-1, 1, 1, 0]. Step 1 (odd, zeros and ties -> +1):
    # signs [+,-,+,+] and [-,+,+,+], sums [0, 0, 2, 2] -> Delta = [1, 1, 1, 1], x = -0.5.
    run = simulate_hybrid([torch.zeros(3)], _hand_grads, 2, 2, 1, **HAND)
    assert run.partition_sizes == [2]
    assert run.params_per_step[0][0].tolist() == [-0.5, -0.5, -0.5]
    assert run.masters[0].tolist() == [-0.5] * 4  # the padding moves too
    assert [m[0].tolist() for m in run.momenta] == [[0.5, -1.0, 0.0, 0.0], [-1.0, 1.0, 1.0, 0.0]]
    assert run.shard(run.momenta[1][0], 0, 1).tolist() == [1.0, 0.0]  # rank 3 = (node 1, shard 1)
    # Step 2 (even, -1): g = 0, c = m/2: signs [+,-,-,-] and [-,+,+,-], sums [0, 0, 0, -2] -> all -1.
    run = simulate_hybrid([torch.zeros(3)], _hand_grads, 2, 2, 2, **HAND)
    assert run.params_per_step[1][0].tolist() == [0.0, 0.0, 0.0]
    assert run.lioncub_steps == [1, 2] and run.skipped == [False, False]


def test_hand_worked_l1_mean_takes_the_scale_over_the_whole_shard_padding_included() -> None:
    # 4-bit all-reduce over 2 nodes: L = 3, tau = 2, q = round(c / mu * 1.5) with mu per shard.
    # node 0: shard 0 [.5, -1] mu .75 -> [1, -2]; shard 1 [0, 0] -> [0, 0].
    # node 1: shard 0 [-1, 1] mu 1 -> [-2 (half to even), 2]; shard 1 [1, 0] mu .5 (padding counts) -> [3, 0].
    # Delta = sum / (2 * 3) = [-1/6, 0, 1/2, 0] (mean: no tie rule); without the padding mu would be 1 -> 2/6.
    run = simulate_hybrid(
        [torch.zeros(3)], _hand_grads, 2, 2, 1, compression="kbit", bits=4, quantizer="l1", aggregation="mean", **HAND
    )
    torch.testing.assert_close(run.masters[0], -0.5 * T([-1 / 6, 0.0, 0.5, 0.0]), rtol=0, atol=1e-7)


def test_node_average_divides_then_sums_and_clipping_is_per_node() -> None:
    grads = [T([3.0, 4.0]), T([3.0, 4.0]), T([0.3, 0.4]), T([0.3, 0.4])]
    run = simulate_hybrid(
        [torch.zeros(2)], lambda r, t, m, ps: [grads[r]], 2, 2, 1, groups_padding=[0], gradient_clipping=1.0, lr=0.1
    )
    assert run.node_grad_norms[0] == pytest.approx([5.0, 0.5])  # node 1's norm is under the clip: unchanged
    # momentum = (1 - b2) * clipped node gradient: node 0 scaled by 1 / (5 + 1e-6), node 1 not at all
    torch.testing.assert_close(run.momenta[0][0], 0.01 * T([0.6, 0.8]), rtol=1e-6, atol=0)
    torch.testing.assert_close(run.momenta[1][0], 0.01 * T([0.3, 0.4]), rtol=0, atol=0)


def test_accumulation_orders_and_scaling() -> None:
    # Two micro-batches per rank, each divided by 2; either order gives (1 + 3)/2 on one rank of one node.
    micro = [[T([1.0])], [T([3.0])]]
    for after in (False, True):
        run = simulate_hybrid(
            [torch.zeros(1)],
            lambda r, t, m, ps: micro[m],
            1,
            1,
            1,
            groups_padding=[0],
            gradient_accumulation_steps=2,
            accumulate_after_reduce=after,
            betas=(0.9, 0.5),
        )
        assert run.momenta[0][0].tolist() == [1.0]  # (1 - 0.5) * 2


def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere() -> None:
    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        value = float("nan") if (rank, step) == (3, 2) else float(rank + step) - 2.5
        return [torch.full((4,), value)]

    run = simulate_hybrid([torch.ones(4)], grads, 2, 2, 3, groups_padding=[0], lr=0.1)
    assert run.skipped == [False, True, False]
    assert run.lioncub_steps == [1, 1, 2]
    assert torch.equal(run.params_per_step[0][0], run.params_per_step[1][0])
    assert all(bool(torch.isfinite(m[0]).all()) for m in run.momenta)


def _random_grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * step + micro)
    return [torch.randn(p.shape, generator=gen) + 0.1 * p for p in params]


INIT = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(5), torch.randn(2, 3)]


@pytest.mark.parametrize(
    "mode",
    [
        dict(compression="1bit"),
        dict(compression="1bit", tie_break="positive"),
        dict(compression="kbit", bits=4, quantizer="sign"),
        dict(compression="kbit", bits=2, quantizer="sign", kbit_algorithm="alltoall", aggregation="mean"),
        dict(compression="1bit", momentum_sync_interval=2),
    ],
)
@pytest.mark.parametrize("padding", [0, 3])
def test_node_size_one_is_stage0_lioncub(mode: dict, padding: int) -> None:
    """G = 1: every rank is a node, its gradient its own; the padding elements never touch a parameter."""
    lr = lambda t: 0.01 / t  # noqa: E731
    run = simulate_hybrid(INIT, _random_grads, 4, 1, 5, groups_padding=[padding], lr=lr, weight_decay=0.1, **mode)
    sync = mode.pop("momentum_sync_interval", 0)
    params, exp_avgs = simulate_lioncub(
        INIT,
        lambda r, t, ps: _random_grads(r, t, 0, ps),
        4,
        5,
        lr=lr,
        weight_decay=0.1,
        momentum_sync_interval=sync,
        **mode,
    )
    for a, b in zip(run.params_per_step[-1], params, strict=True):
        assert torch.equal(a, b)
    for node in range(4):
        flat = torch.cat([m.reshape(-1) for m in exp_avgs[node]])
        assert torch.equal(run.momenta[node][0][: flat.numel()], flat)


def test_node_size_one_l1_equals_stage0_for_a_single_unpadded_tensor() -> None:
    """The L1 scale is per shard under ZeRO and per tensor at stage 0: the same thing for one tensor, G = 1."""
    init = [torch.randn(40, generator=torch.Generator().manual_seed(2))]
    mode = dict(compression="kbit", bits=8, quantizer="l1")
    run = simulate_hybrid(init, _random_grads, 3, 1, 4, groups_padding=[0], lr=0.01, **mode)
    params, _ = simulate_lioncub(init, lambda r, t, ps: _random_grads(r, t, 0, ps), 3, 4, lr=0.01, **mode)
    assert torch.equal(run.params_per_step[-1][0], params[0])


def test_one_node_of_exact_lion_is_lion_on_the_node_average() -> None:
    run = simulate_hybrid(
        INIT, _random_grads, 1, 2, 3, groups_padding=[1], compression="none", lr=0.01, weight_decay=0.1
    )
    ref = [t.clone() for t in INIT]
    ref_m = [torch.zeros_like(t) for t in INIT]
    for step in range(1, 4):
        per_rank = [_random_grads(r, step, 0, [t.clone() for t in ref]) for r in range(2)]
        mean = [a / 2 + b / 2 for a, b in zip(*per_rank, strict=True)]
        reference_lion_step(ref, mean, ref_m, 0.01, (0.9, 0.99), 0.1)
        for a, b in zip(run.params_per_step[step - 1], ref, strict=True):
            assert torch.equal(a, b)


def test_param_groups_are_flattened_and_stepped_separately() -> None:
    """Two groups with their own padding and weight decay; nodes vote per element, so groups only split the data."""
    groups = [[0, 2], [1]]
    run = simulate_hybrid(
        INIT, _random_grads, 2, 2, 3, groups_padding=[2, 1], param_groups=groups, lr=0.01, weight_decay=[0.1, 0.0]
    )
    assert run.partition_sizes == [(12 + 6 + 2) // 2, (5 + 1) // 2]
    assert run.masters[1][:5].tolist() == run.params_per_step[-1][1].tolist()
    assert torch.equal(run.masters[0][12:18], run.params_per_step[-1][2].reshape(-1))
    with pytest.raises(ValueError):
        simulate_hybrid(INIT, _random_grads, 2, 2, 1, groups_padding=[0], param_groups=groups)
    with pytest.raises(ValueError):
        simulate_hybrid(INIT, _random_grads, 2, 2, 1, groups_padding=[0])  # 23 elements do not split in 2


EF_MODES = [
    dict(bits=2, kbit_algorithm="alltoall", error_feedback={"kind": "residual", "beta": 0.8, "reset_interval": 3}),
    dict(bits=4, kbit_algorithm="allreduce", aggregation="mean", error_feedback={"kind": "residual"}),
    dict(bits=4, kbit_algorithm="alltoall", error_feedback={"kind": "ef21"}),
]


def _fixed_grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
    """Gradients that do not depend on the parameters: a shard's vote then sees only its own elements."""
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * step + micro)
    return [torch.randn(p.shape, generator=gen) for p in params]


@pytest.mark.parametrize("mode", EF_MODES)
def test_node_size_one_with_error_feedback_is_the_stage0_error_feedback_simulation(mode: dict) -> None:
    """G = 1, one unpadded tensor (the L1 scale and EF21's spread are per shard under ZeRO, per tensor at
    stage 0: the same thing here): parameters and every node's EF state are the stage-0 EF world's."""
    init = [torch.randn(40, generator=torch.Generator().manual_seed(2))]
    options = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, bucket_size=1 << 23, **mode)
    run = simulate_hybrid(
        init, _random_grads, 3, 1, 5, groups_padding=[0], compression="kbit", quantizer="l1", **options
    )
    world = simulate_ef(init, lambda r, t, ps: _random_grads(r, t, 0, ps), 3, 5, options)
    assert torch.equal(run.params_per_step[-1][0], world.params[0])
    assert len(run.feedback) == 1
    kept = 0
    for name in ("residual", "estimate", "shared"):
        got, expected = getattr(run.feedback[0], name), getattr(world, name)
        assert got.keys() == expected.keys(), name
        for key in expected:
            pairs = zip(got[key], expected[key], strict=True) if name != "shared" else [(got[key], expected[key])]
            assert all(torch.equal(a, b) for a, b in pairs), (name, key)
            kept += 1
    assert kept > 0, "no EF state kept"


@pytest.mark.parametrize("mode", EF_MODES)
def test_each_shard_votes_with_its_own_error_feedback_state(mode: dict) -> None:
    """2 nodes x 2 ranks, one tensor of 9 (+1 padding): shard j's masters and EF state are those of a stage-0 EF
    world of 2 workers on shard j's elements, each worker's gradient its node's (the mean of its 2 ranks)."""
    init = [torch.randn(9, generator=torch.Generator().manual_seed(3))]
    options = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.0, bucket_size=1 << 23, **mode)
    run = simulate_hybrid(
        init, _fixed_grads, 2, 2, 4, groups_padding=[1], compression="kbit", quantizer="l1", **options
    )
    padded = torch.cat([init[0], torch.zeros(1)])

    def shard_grads(j: int) -> object:
        def grads(node: int, step: int, params: list[Tensor]) -> list[Tensor]:
            ranks = [_fixed_grads(2 * node + r, step, 0, [torch.zeros(9)])[0] for r in range(2)]
            total = torch.zeros(9)
            for g in ranks:
                total += g / 2
            return [torch.cat([total, torch.zeros(1)])[5 * j : 5 * (j + 1)]]

        return grads

    for j in range(2):
        world = simulate_ef([padded[5 * j : 5 * (j + 1)]], shard_grads(j), 2, 4, options)
        assert torch.equal(run.shard(run.masters[0], 0, j), world.params[0]), j
        state = run.feedback[j]
        for name in ("residual", "estimate"):
            for got, expected in zip(getattr(state, name).values(), getattr(world, name).values(), strict=True):
                assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (j, name)
        assert bool(run.feedback[j].residual or run.feedback[j].estimate), "no EF state kept"
