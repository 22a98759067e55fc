"""Hand-worked checks of tests/support/reference.py, so that the references themselves can be trusted."""

from __future__ import annotations

import pytest
import torch

from tests.support.reference import (
    brute_force_vote_1bit,
    brute_force_vote_kbit,
    l1_quantize,
    max_world_size_allreduce,
    maxnorm_quantize,
    reference_compressed_allreduce,
    reference_lion_step,
    simulate_lioncub,
    tie_value,
)

T = torch.tensor

# p = 4. Local signs (zeros resolved by the tie) sum to 0 in columns 0 and 1 (vote ties) and the
# zeros of column 2 flip the vote of column 2 between odd and even steps.
UPDATES_P4 = [
    T([1.0, -1.0, 0.0, 2.0]),
    T([1.0, -1.0, -3.0, -1.0]),
    T([-1.0, 1.0, 5.0, -1.0]),
    T([-1.0, 1.0, 0.0, -1.0]),
]


def test_tie_value() -> None:
    assert [tie_value(t, "alternate") for t in (1, 2, 3, 4)] == [1, -1, 1, -1]
    assert [tie_value(t, "positive") for t in (1, 2)] == [1, 1]
    with pytest.raises(ValueError):
        tie_value(1, "random")


def test_vote_1bit_ties_odd_and_even_step() -> None:
    # odd step: column 2 local signs +,-,+,+ -> S=2; columns 0,1 tie -> +1; column 3 S=-2
    assert brute_force_vote_1bit(UPDATES_P4, 1, "alternate").tolist() == [1, 1, 1, -1]
    # even step: column 2 local signs -,-,+,- -> S=-2; ties -> -1
    assert brute_force_vote_1bit(UPDATES_P4, 2, "alternate").tolist() == [-1, -1, -1, -1]
    assert brute_force_vote_1bit(UPDATES_P4, 2, "positive").tolist() == [1, 1, 1, -1]
    out = brute_force_vote_1bit([u.to(torch.bfloat16).reshape(2, 2) for u in UPDATES_P4], 1)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2)
    assert brute_force_vote_1bit([torch.zeros(0)] * 3, 1).numel() == 0


def test_vote_kbit_sign() -> None:
    for step in (1, 2):
        assert torch.equal(
            brute_force_vote_kbit(UPDATES_P4, step, 4, "sign", "vote"), brute_force_vote_1bit(UPDATES_P4, step)
        )
    # mean = S / p: S = [0, 0, 2, -2] on odd steps, [0, 0, -2, -2] on even steps
    assert brute_force_vote_kbit(UPDATES_P4, 1, 4, "sign", "mean").tolist() == [0.0, 0.0, 0.5, -0.5]
    assert brute_force_vote_kbit(UPDATES_P4, 2, 4, "sign", "mean", "alltoall").tolist() == [0.0, 0.0, -0.5, -0.5]


def test_world_size_limits() -> None:
    assert [max_world_size_allreduce(b, "sign") for b in (2, 4, 8)] == [3, 15, 255]
    assert [max_world_size_allreduce(b, "l1") for b in (2, 4, 8)] == [1, 7, 127]
    with pytest.raises(ValueError):
        brute_force_vote_kbit(UPDATES_P4, 1, 2, "sign")  # p=4 > 3
    with pytest.raises(ValueError):
        brute_force_vote_kbit(UPDATES_P4[:2], 1, 2, "l1")  # L = floor(3/4) = 0
    brute_force_vote_kbit(UPDATES_P4, 1, 4, "l1")  # L = floor(15/8) = 1: fits
    brute_force_vote_kbit(UPDATES_P4, 1, 2, "sign", algorithm="alltoall")  # all-to-all has no limit
    with pytest.raises(ValueError):
        brute_force_vote_kbit(UPDATES_P4, 1, 3)


def test_l1_quantize_by_hand() -> None:
    # mu = 1, L = 3, clip 2: c * 1.5 = [3, -1.5, .75, 0, -.75, -3]; -1.5 rounds half-to-even to -2
    assert l1_quantize(T([2.0, -1.0, 0.5, 0.0, -0.5, -2.0]), 3, 2.0).tolist() == [3, -2, 1, 0, -1, -3]
    # mu = 2, clip 1: c * 1.5 = [-6, 1.5, 0, 0, 4.5, 6] -> round [-6, 2, 0, 0, 4, 6] -> clamp to +-3
    assert l1_quantize(T([-4.0, 1.0, 0.0, 0.0, 3.0, 4.0]), 3, 1.0).tolist() == [-3, 2, 0, 0, 3, 3]
    assert l1_quantize(torch.zeros(5), 3, 2.0).tolist() == [0] * 5
    assert maxnorm_quantize(T([4.0, -1.0, 0.5, 2.0]), 2).tolist() == [2, 0, 0, 1]  # -0.5 -> -0, 1.0 -> 1


def test_vote_kbit_l1_by_hand() -> None:
    # p=2, 4 bits, allreduce: L = floor(15/4) = 3, clip 2.
    # rank 0: mu = 1, q = [3, -2, 1, 0, -1, -3]; rank 1: mu = 2, c*0.75 = [-3, .75, 0, 0, 2.25, 3]
    # -> q = [-3, 1, 0, 0, 2, 3]; Q = [0, -1, 1, 0, 1, 0]; ties at 0 and 3 and 5
    c = [T([2.0, -1.0, 0.5, 0.0, -0.5, -2.0]), T([-4.0, 1.0, 0.0, 0.0, 3.0, 4.0])]
    assert brute_force_vote_kbit(c, 1, 4, "l1", "vote").tolist() == [1, -1, 1, 1, 1, 1]
    assert brute_force_vote_kbit(c, 2, 4, "l1", "vote").tolist() == [-1, -1, 1, -1, 1, -1]
    mean = brute_force_vote_kbit(c, 1, 4, "l1", "mean")  # Q / (p*L) = Q / 6
    assert torch.equal(mean, T([0.0, -1.0, 1.0, 0.0, 1.0, 0.0]) / 6)
    # all-to-all: L = 7. rank 0: c*3.5 -> [7, -4, 2, 0, -2, -7]; rank 1: c*1.75 -> [-7, 2, 0, 0, 5, 7]
    assert brute_force_vote_kbit(c, 2, 4, "l1", "mean", "alltoall").tolist() == pytest.approx(
        [0.0, -2 / 14, 2 / 14, 0.0, 3 / 14, 0.0]
    )


def test_vote_kbit_l1_segments() -> None:
    # Per-segment mu: [2,-2,2 | .25,-.25,.25] -> mu 2 and .25 -> c/mu*1.5 = +-1.5 -> q = +-2 everywhere.
    # One segment: mu = 1.125, the small half gives 0.333 -> 0 -> tie. Rank 1 sends zeros (mu 0 -> q 0).
    c = [T([2.0, -2.0, 2.0, 0.25, -0.25, 0.25]), torch.zeros(6)]
    assert brute_force_vote_kbit(c, 2, 4, "l1", segment_sizes=[3, 3]).tolist() == [1, -1, 1, 1, -1, 1]
    assert brute_force_vote_kbit(c, 2, 4, "l1").tolist() == [1, -1, 1, -1, -1, -1]
    with pytest.raises(ValueError):
        brute_force_vote_kbit(c, 2, 4, "l1", segment_sizes=[3, 2])


def test_compressed_allreduce_by_hand() -> None:
    # p=2, n=3 padded to 16. Rank 0: x = [3,-4,0,0...], |x| = 5, scale 5/4, signs [+,-,+,+...].
    # Rank 1: x = 0, scale 0. Server chunks (8 each): y = 1.25/2 * signs, scale 0.625, error 0.
    bufs = [T([3.0, -4.0, 0.0]), torch.zeros(3)]
    we = [torch.zeros(16), torch.zeros(16)]
    se = [torch.zeros(8), torch.zeros(8)]
    out, new_we, new_se = reference_compressed_allreduce(bufs, we, se)
    assert out[0].tolist() == [0.625, -0.625, 0.625] and torch.equal(out[0], out[1])
    assert new_we[0].tolist() == [1.75, -2.75, -1.25] + [-1.25] * 13
    assert new_we[1].tolist() == [0.0] * 16
    assert all(e.tolist() == [0.0] * 8 for e in new_se)
    assert bufs[0].tolist() == [3.0, -4.0, 0.0] and we[0].tolist() == [0.0] * 16  # inputs untouched


def test_compressed_allreduce_exact_for_constant_magnitude() -> None:
    # Identical +-a buffers: both compressions are lossless, output == input, errors stay 0.
    p, n = 4, 64
    buf = 0.5 * torch.where(torch.arange(n) % 3 == 0, 1.0, -1.0).reshape(8, 8)
    out, we, se = reference_compressed_allreduce([buf] * p, [torch.zeros(n)] * p, [torch.zeros(n // p)] * p)
    assert all(torch.equal(o, buf) for o in out)
    assert all(float(e.abs().max()) == 0.0 for e in we + se)
    with pytest.raises(ValueError):
        reference_compressed_allreduce([buf] * p, [torch.zeros(48)] * p, [torch.zeros(12)] * p)


def test_lion_step_by_hand() -> None:
    # c = 0.9*m + 0.1*g = [0.05, 0.18, 0]; p = p*(1 - 0.1*0.1) - 0.1*sign(c); m = 0.99*m + 0.01*g
    params = [T([1.0, -1.0, 2.0])]
    exp_avgs = [T([0.0, 0.2, 0.0])]
    reference_lion_step(params, [T([0.5, 0.0, 0.0])], exp_avgs, 0.1, (0.9, 0.99), 0.1)
    assert params[0].tolist() == pytest.approx([0.89, -1.09, 1.98])
    assert exp_avgs[0].tolist() == pytest.approx([0.005, 0.198, 0.0])


def test_simulate_1bit_by_hand() -> None:
    # Step 1, m = 0: c_r = 0.1*g_r, local signs [+,-] and [-,-], S = [0, -2] -> tie +1 -> [1, -1].
    grads = [T([1.0, -1.0]), T([-1.0, -1.0])]
    params, exp_avgs = simulate_lioncub([torch.zeros(2)], lambda r, t, ps: [grads[r]], 2, 1, lr=0.5)
    assert params[0].tolist() == [-0.5, 0.5]
    assert [m[0].tolist() for m in exp_avgs] == [pytest.approx([0.01, -0.01]), pytest.approx([-0.01, -0.01])]


def _grads(rank: int, step: int, params: list[torch.Tensor], same: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + (0 if same else rank))
    return [torch.randn(p.shape, generator=gen) + 0.1 * p for p in params]


@pytest.mark.parametrize(
    "world_size, mode",
    [
        (2, dict(compression="none")),  # p = 2: (g + g) / 2 == g exactly
        (3, dict(compression="1bit")),
        (3, dict(compression="kbit", bits=4, quantizer="sign")),
        (3, dict(compression="kbit", bits=2, quantizer="sign", kbit_algorithm="alltoall")),
    ],
)
def test_simulation_with_identical_grads_is_exact_lion(world_size: int, mode: dict) -> None:
    # Same grads everywhere: every vote is unanimous and c has no zeros, so LionCub == Lion bitwise.
    init = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(5)]
    lr = lambda t: 0.01 / t  # noqa: E731  (a schedule, to check per-step lr is honoured)
    params, exp_avgs = simulate_lioncub(
        init, lambda r, t, ps: _grads(r, t, ps, True), world_size, 4, lr=lr, weight_decay=0.1, **mode
    )
    ref = [t.clone() for t in init]
    ref_m = [torch.zeros_like(t) for t in init]
    for t in range(1, 5):
        reference_lion_step(ref, _grads(0, t, ref, True), ref_m, lr(t), (0.9, 0.99), 0.1)
    for a, b in zip(params, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for m_rank in exp_avgs:
        for a, b in zip(m_rank, ref_m, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_simulation_momentum_sync() -> None:
    init = [torch.zeros(6), torch.zeros(2)]
    _, exp_avgs = simulate_lioncub(
        init,
        lambda r, t, ps: _grads(r, t, ps, False),
        3,
        2,
        compression="kbit",
        quantizer="l1",
        bits=8,
        momentum_sync_interval=2,
        momentum_sync_params=[0],
    )
    assert all(torch.equal(exp_avgs[0][0], m[0]) for m in exp_avgs)  # synced
    assert not torch.equal(exp_avgs[0][1], exp_avgs[1][1])  # not selected
