"""ds_lioncub.comm.quantize: tie rule, L1 quantizer, level counts, world-size checks, field widths.

Expected values are hand-worked or come from the formulas (tie rule, L1 quantizer, levels and world-size
limits) as tests/support/reference.py writes them.
"""

from __future__ import annotations

import re

import pytest
import torch

from ds_lioncub.comm.quantize import (
    check_kbit_world_size,
    field_width_for,
    l1_levels,
    quantize_l1,
    sign_with_tie,
    tie_sign,
)
from tests.support.reference import l1_quantize, max_world_size_allreduce, maxnorm_quantize, tie_value

# ------------------------------------------------------------------ tie rule


def test_tie_sign_alternates_with_step_parity() -> None:
    assert [tie_sign(t, "alternate") for t in range(1, 7)] == [1, -1, 1, -1, 1, -1]
    assert [tie_sign(t, "positive") for t in range(1, 7)] == [1] * 6
    for t in range(1, 20):
        assert tie_sign(t, "alternate") == tie_value(t, "alternate")


def test_tie_sign_rejects_unknown_rule() -> None:
    with pytest.raises(ValueError, match="random"):
        tie_sign(1, "random")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sign_with_tie(dtype: torch.dtype) -> None:
    x = torch.tensor([2.0, -3.0, 0.0, -0.0, 1e-3, -1e-3], dtype=dtype)
    odd = sign_with_tie(x, 1, "alternate")
    even = sign_with_tie(x, 2, "alternate")
    assert odd.dtype == dtype
    assert odd.tolist() == [1, -1, 1, 1, 1, -1]
    assert even.tolist() == [1, -1, -1, -1, 1, -1]
    assert sign_with_tie(x, 2, "positive").tolist() == [1, -1, 1, 1, 1, -1]


def test_sign_with_tie_keeps_shape() -> None:
    x = torch.zeros(2, 3)
    assert sign_with_tie(x, 4, "alternate").shape == (2, 3)
    assert sign_with_tie(x, 4, "alternate").eq(-1).all()


# ------------------------------------------------------------------ levels


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("p", range(1, 20))
def test_l1_levels_formula(p: int, bits: int) -> None:
    assert l1_levels(p, bits, "allreduce") == (2**bits - 1) // (2 * p)
    assert l1_levels(p, bits, "alltoall") == (2**bits - 1) // 2  # independent of p


def test_l1_levels_hand_values() -> None:
    assert l1_levels(4, 8, "allreduce") == 31
    assert l1_levels(4, 4, "allreduce") == 1
    assert l1_levels(2, 2, "allreduce") == 0  # 2-bit l1 cannot serve two workers by all-reduce
    assert [l1_levels(9, b, "alltoall") for b in (2, 4, 8)] == [1, 7, 127]


# ------------------------------------------------------------------ L1 quantizer


def test_quantize_l1_hand_worked_with_given_mu() -> None:
    # mu = 1, L = 4, clip = 2: c * 4 / (2 * 1) = 2c, rounded half to even, clamped to [-4, 4].
    c = torch.tensor([3.0, -1.0, 0.5, -0.25, 0.0, 8.0, 0.75, 1.25, -9.0])
    # 2c = [6, -2, 1, -0.5, 0, 16, 1.5, 2.5, -18]
    q = quantize_l1(c, 1.0, 4, 2.0)
    assert q.dtype == torch.int32
    assert q.tolist() == [4, -2, 1, 0, 0, 4, 2, 2, -4]


def test_quantize_l1_hand_worked_with_mean_abs() -> None:
    # c's mean |c| is 3; L = 3, clip = 2 -> scale 3 / (2 * 3) = 0.5: [0.5, -1, 1.5, -3] -> [0, -1, 2, -3]
    c = torch.tensor([1.0, -2.0, 3.0, -6.0])
    mu = c.abs().mean()
    assert quantize_l1(c, mu, 3, 2.0).tolist() == [0, -1, 2, -3]


@pytest.mark.parametrize("levels", [1, 7, 31, 127])
def test_quantize_l1_clips_at_plus_minus_levels(levels: int) -> None:
    c = torch.tensor([1e6, -1e6, 50.0, -50.0, 1.0])
    q = quantize_l1(c, 1.0, levels, 2.0)
    assert q[:4].tolist() == [levels, -levels, levels, -levels]
    assert int(q.abs().max()) == levels


def test_quantize_l1_zero_mean_gives_zeros() -> None:
    for mu in (0.0, torch.tensor(0.0)):
        q = quantize_l1(torch.zeros(3, 4), mu, 7, 2.0)
        assert q.dtype == torch.int32 and q.shape == (3, 4) and not q.any()


@pytest.mark.parametrize("clip", [0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("levels", [1, 3, 31])
def test_quantize_l1_matches_reference(levels: int, clip: float) -> None:
    g = torch.Generator().manual_seed(levels * 10 + int(clip * 2))
    c = torch.randn(2000, generator=g) * torch.rand(2000, generator=g) * 3
    q = quantize_l1(c.view(40, 50), c.abs().mean(), levels, clip)
    assert q.shape == (40, 50)
    assert torch.equal(q.view(-1), l1_quantize(c, levels, clip))


# ------------------------------------------------------------------ world-size check


@pytest.mark.parametrize("quantizer", ["sign", "l1"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_check_kbit_world_size_boundary_and_message(bits: int, quantizer: str) -> None:
    largest = max_world_size_allreduce(bits, quantizer)  # brute-force count in the reference
    check_kbit_world_size(largest, bits, quantizer, "allreduce")  # fits: no error
    check_kbit_world_size(10_000, bits, quantizer, "alltoall")  # all-to-all fits any world
    with pytest.raises(ValueError) as raised:
        check_kbit_world_size(largest + 1, bits, quantizer, "allreduce")
    message = str(raised.value)
    # The largest world that works and the size asked for, as whole numbers, plus the alternatives.
    assert re.search(rf"\b{largest}\b", message), message
    assert re.search(rf"\b{largest + 1}\b", message), message
    assert "alltoall" in message and "1bit" in message, message


@pytest.mark.parametrize(
    ("p", "bits", "quantizer", "wider"),
    [(5, 2, "sign", 4), (16, 4, "sign", 8), (2, 2, "l1", 4), (8, 4, "l1", 8)],
)
def test_check_kbit_world_size_suggests_wider_field(p: int, bits: int, quantizer: str, wider: int) -> None:
    with pytest.raises(ValueError, match=f"bits={wider}"):
        check_kbit_world_size(p, bits, quantizer, "allreduce")


def test_check_kbit_world_size_no_wider_field_when_none_fits() -> None:
    with pytest.raises(ValueError) as raised:
        check_kbit_world_size(128, 8, "l1", "allreduce")
    assert "bits=" not in str(raised.value)  # 8 is the widest; suggesting bits=16 would be wrong


@pytest.mark.parametrize("bits", [1, 3, 16])
def test_check_kbit_world_size_rejects_bad_width(bits: int) -> None:
    with pytest.raises(ValueError, match=rf"\b{bits}\b"):
        check_kbit_world_size(1, bits, "sign", "allreduce")


# ------------------------------------------------------------------ field widths


def test_field_width_for_hand_values() -> None:
    cases = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 15: 4, 16: 8, 255: 8, 256: 16, 65535: 16, 65536: 32, 2**32 - 1: 32}
    for value, width in cases.items():
        assert field_width_for(value) == width, value
    with pytest.raises(ValueError):
        field_width_for(2**32)


def test_field_width_for_matches_loop() -> None:
    for value in range(0, 70_000, 7):
        expected = next(w for w in (1, 2, 4, 8, 16, 32) if value < 2**w)
        assert field_width_for(value) == expected


# ------------------------------------------------------------------ paper Fig. 5: L1 vs max-norm


def laplace(n: int, seed: int) -> torch.Tensor:
    """Laplace(0, 1) samples by inverse CDF (seeded, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()


def sign_rates(q: torch.Tensor, c: torch.Tensor) -> tuple[float, float]:
    """(match, flip): share of sign(q) == sign(c) (q == 0 is a mismatch) and of sign(q) == -sign(c)."""
    match = (torch.sign(q) == torch.sign(c)).double().mean().item()
    flip = (torch.sign(q) == -torch.sign(c)).double().mean().item()
    return match, flip


# Measured (1e5 Laplace samples + 5 outliers, p = 4):
#   4 bits, L = 1:  l1 match 0.367, max-norm 0.000;  8 bits, L = 31: l1 0.969, max-norm 0.200; flips 0.
@pytest.mark.parametrize(("bits", "margin"), [(4, 0.25), (8, 0.5)])
def test_l1_quantizer_keeps_signs_that_max_norm_loses(bits: int, margin: float) -> None:
    c = laplace(100_000, seed=0)
    c[:5] = torch.tensor([60.0, -80.0, 100.0, -45.0, 70.0])  # a few outliers set max-norm's scale
    levels = l1_levels(4, bits, "allreduce")
    l1_match, l1_flip = sign_rates(quantize_l1(c, c.abs().mean(), levels, 2.0), c)
    max_match, max_flip = sign_rates(maxnorm_quantize(c, levels), c)
    print(
        f"bits={bits} L={levels}: l1 match {l1_match:.4f} flip {l1_flip:.5f}; "
        f"max-norm match {max_match:.4f} flip {max_flip:.5f}"
    )
    assert l1_match >= max_match + margin
    assert l1_flip <= max_flip
    assert l1_flip == 0.0  # rounding a positively scaled value never flips its sign


# Measured (4 workers, shared Laplace signal + Laplace noise, 8 bits, L = 31), vs exact sign(sum c):
#   l1 match 0.987 flip 0.005; max-norm match 0.679 flip 0.014.
def test_l1_vote_tracks_exact_lion_better_than_max_norm() -> None:
    signal = laplace(100_000, seed=2)
    workers = [signal + laplace(100_000, seed=10 + r) for r in range(4)]
    for c in workers:
        c[:3] = torch.tensor([100.0, -90.0, 80.0])
    exact = sum(workers)
    levels = l1_levels(4, 8, "allreduce")
    l1_sum = sum(quantize_l1(c, c.abs().mean(), levels, 2.0) for c in workers)
    max_sum = sum(maxnorm_quantize(c, levels) for c in workers)
    l1_match, l1_flip = sign_rates(l1_sum, exact)
    max_match, max_flip = sign_rates(max_sum, exact)
    print(
        f"vote of 4, 8 bits: l1 match {l1_match:.4f} flip {l1_flip:.4f}; "
        f"max-norm match {max_match:.4f} flip {max_flip:.4f}"
    )
    assert l1_match >= max_match + 0.2
    assert l1_flip <= max_flip


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_summed_fields_never_carry_for_every_world_the_width_allows(bits: int) -> None:
    """A uint8 SUM all-reduce of packed fields, simulated byte by byte (mod 256, as gloo/NCCL wrap),
    unpacks to the exact per-field sums for every p the width admits, with every worker at its maximum."""
    from ds_lioncub.comm.packing import pack_fields, unpack_fields

    numel = 64
    generator = torch.Generator().manual_seed(bits)
    for quantizer, top_value in (("sign", 1), ("l1", None)):
        for p in range(1, max_world_size_allreduce(bits, quantizer) + 1):
            largest = top_value if top_value is not None else 2 * ((2**bits - 1) // (2 * p))
            fields = [torch.randint(0, largest + 1, (numel,), generator=generator) for _ in range(p)]
            for worker in fields:  # the worst case: every worker sends its maximum
                worker[:8] = largest
            byte_sums = torch.zeros(numel * bits // 8, dtype=torch.int64)
            for worker in fields:
                byte_sums += pack_fields(worker.to(torch.uint8), bits).to(torch.int64)
            wrapped = (byte_sums % 256).to(torch.uint8)
            expected = torch.stack(fields).sum(dim=0)
            assert torch.equal(unpack_fields(wrapped, bits, numel).to(torch.int64), expected), (quantizer, p)
