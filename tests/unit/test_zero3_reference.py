"""Checks of tests.support.zero3_reference.simulate_hybrid_zero3 (compressed LionCub under ZeRO-3 as a hybrid) by
hand and against the stage-0 and ZeRO-1/2 simulations, so that the launcher tests compare with a trusted reference."""

from __future__ import annotations

import torch
from torch import Tensor

from tests.support.reference import simulate_hybrid, simulate_lioncub
from tests.support.zero3_reference import simulate_hybrid_zero3

T = torch.tensor


def _grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
    """Two parameters of 3 and 2 elements; a pure function of (rank, step, micro, params)."""
    generator = torch.Generator().manual_seed(97 * rank + 13 * step + micro)
    return [torch.randn(3, generator=generator) + params[0], torch.randn(2, generator=generator) - params[1]]


INIT = [T([0.5, -0.25, 1.0]), T([2.0, -1.0])]


def test_hand_worked_slices_pad_each_parameter_and_the_padding_moves() -> None:
    # G = 2: parameter 0 (3 elements) -> slices [x0, x1] and [x2, pad]; parameter 1 (2) -> [y0] and [y1].
    # One node, zero gradients: c = 0 everywhere, so every element (padding too) moves by the tie (+1 at step 1).
    run = simulate_hybrid_zero3(
        [torch.zeros(3), torch.zeros(2)],
        lambda r, t, m, ps: [torch.zeros(3), torch.zeros(2)],
        1,
        2,
        1,
        sub_groups=[[0], [1]],
        weight_decays=[0.0, 0.0],
        lr=0.5,
    )
    assert [m.tolist() for m in run.masters[0]] == [[-0.5, -0.5], [-0.5, -0.5]]  # slice 1 = [x2, padding]
    assert [m.tolist() for m in run.masters[1]] == [[-0.5], [-0.5]]
    assert run.params_per_step[0][0].tolist() == [-0.5] * 3 and run.params_per_step[0][1].tolist() == [-0.5] * 2


def test_node_size_one_is_stage0_lioncub() -> None:
    """G = 1: each rank is a node holding whole parameters; the vote is stage 0's."""
    for compression, extra in (("1bit", {}), ("kbit", {"bits": 8, "quantizer": "sign"})):
        run = simulate_hybrid_zero3(
            INIT, _grads, 4, 1, 4, sub_groups=[[0, 1]], weight_decays=[0.1], lr=0.01, compression=compression, **extra
        )
        params, momenta = simulate_lioncub(
            INIT,
            lambda r, t, ps: _grads(r, t, 0, ps),
            4,
            4,
            lr=0.01,
            weight_decay=0.1,
            compression=compression,
            **extra,
        )
        assert all(torch.equal(a, b) for a, b in zip(run.params_per_step[-1], params, strict=True)), compression
        for rank in range(4):
            assert torch.equal(run.momenta[rank][0][0], torch.cat(momenta[rank])), (compression, rank)


def test_one_sub_group_of_parameters_that_split_evenly_is_the_zero12_hybrid() -> None:
    """Parameters whose sizes G divides: ZeRO-3's slices of one sub-group hold the ZeRO-1/2 shard's elements in
    another order; the 1-bit vote is element-wise, so parameters, clipping and accumulation agree."""
    init = [T([0.5, -0.25, 1.0, 0.0]), T([2.0, -1.0])]

    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        generator = torch.Generator().manual_seed(97 * rank + 13 * step + micro)
        return [torch.randn(4, generator=generator) + params[0], torch.randn(2, generator=generator)]

    common = dict(gradient_accumulation_steps=2, gradient_clipping=0.5, lr=0.01)
    zero3 = simulate_hybrid_zero3(init, grads, 2, 2, 3, sub_groups=[[0, 1]], weight_decays=[0.1], **common)
    zero2 = simulate_hybrid(
        init, grads, 2, 2, 3, groups_padding=[0], accumulate_after_reduce=True, weight_decay=0.1, **common
    )
    for got, expected in zip(zero3.params_per_step, zero2.params_per_step, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert zero3.lioncub_steps == zero2.lioncub_steps == [1, 2, 3]


def test_a_non_finite_gradient_on_one_rank_skips_the_step_and_keeps_the_count() -> None:
    def grads(rank: int, step: int, micro: int, params: list[Tensor]) -> list[Tensor]:
        out = _grads(rank, step, micro, params)
        return [g * float("nan") for g in out] if (rank, step) == (3, 2) else out

    run = simulate_hybrid_zero3(INIT, grads, 2, 2, 3, sub_groups=[[0], [1]], weight_decays=[0.0, 0.0], lr=0.01)
    assert run.skipped == [False, True, False] and run.lioncub_steps == [1, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(run.params_per_step[0], run.params_per_step[1], strict=True))
