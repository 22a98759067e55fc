"""The references' L1 quantizer (tests/support/l1_reference.py) against the library's, on rounding boundaries.

A random update almost never lands within an ulp of a half level, so two quantizers that round in different
orders agree on it by luck; these inputs are built to land there. The values sit within three ulps of
``(k + 1/2) / s``, where ``s = L / (clip * mu)`` is the scale both sides compute: the product ``c * s``
falls on, or just by, a half level, and one extra rounding on the way sends it to the other neighbour.
``old_form`` is the form the references used before (``c / mu * L / clip``): it rounds some of these a
level apart, which is what let the virtual world's L1 tests pass only with a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from ds_lioncub import LionCub
from ds_lioncub.comm.packing import pack_l1_fields, unpack_fields
from ds_lioncub.comm.quantize import l1_segment_scales, quantize_l1
from tests.support.l1_reference import l1_quantize, l1_scale, segment_mean_abs
from tests.support.reference import simulate_lioncub

# (levels, clip): every one has values here that old_form rounds a level apart (2 and 4 bits hold 1 and 7
# levels in an all-to-all, 8 bits 127; clip below and above 1)
CASES = [(7, 2.0), (127, 2.0), (3, 1.5), (7, 0.7), (31, 3.0)]


def field_bits(levels: int) -> int:
    return next(bits for bits in (2, 4, 8) if 2 * levels <= (1 << bits) - 1)


def ulps_away(values: Tensor, steps: Tensor) -> Tensor:
    """Each fp32 value moved ``steps`` representable numbers up (negative: down)."""
    out = values.clone()
    for _ in range(int(steps.abs().max())):
        moving = steps.abs() > 0
        toward = torch.where(steps > 0, torch.inf, -torch.inf)
        out = torch.where(moving, torch.nextafter(out, toward), out)
        steps = steps - steps.sign()
    return out


def near_halves(levels: int, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``count`` half levels ``k + 1/2`` (k in [-L, L)), and how many ulps (-3 to 3) to land from each."""
    halves = torch.randint(-levels, levels, (count,), generator=generator).double() + 0.5
    return halves, torch.randint(-3, 4, (count,), generator=generator)


def boundary_values(scale: Tensor, halves: Tensor, offsets: Tensor) -> Tensor:
    """fp32 values ``offsets`` ulps from ``halves / scale``: ``c * scale`` on, or just by, a half level."""
    return ulps_away((halves / float(scale)).float(), offsets)


def old_form(c: Tensor, levels: int, clip: float, mu: Tensor) -> Tensor:
    """The references' quantizer before: ``round(c / mu * L / clip)``, three roundings before the last."""
    return torch.round(c / mu * levels / clip).clamp(-levels, levels).to(torch.int32)


def rounded_half_away_from_zero(c: Tensor, levels: int, clip: float, mu: Tensor) -> Tensor:
    """The reference with one deliberate change: ties away from zero, not to even (one level at exact halves)."""
    scaled = c.float() * l1_scale(mu, levels, clip)
    return (scaled.sign() * torch.floor(scaled.abs() + 0.5)).clamp(-levels, levels).to(torch.int32)


@pytest.mark.parametrize(("levels", "clip"), CASES)
def test_reference_equals_the_library_on_rounding_boundaries(levels: int, clip: float) -> None:
    generator = torch.Generator().manual_seed(levels * 100 + int(clip * 10))
    mu = torch.rand((), generator=generator) + 0.1
    c = boundary_values(l1_scale(mu, levels, clip), *near_halves(levels, 4000, generator))
    expected = l1_quantize(c, levels, clip, mu)

    assert torch.equal(quantize_l1(c, mu, levels, clip), expected)
    sizes, scales = l1_segment_scales(c, levels, clip, None, [mu])
    bits = field_bits(levels)
    fields = unpack_fields(pack_l1_fields(c, scales, sizes, levels, bits), bits, c.numel())
    assert torch.equal(fields.to(torch.int32) - levels, expected)  # the optimizer's quantize-and-pack pass

    apart = old_form(c, levels, clip, mu) - expected
    assert int(apart.count_nonzero()) > 0 and int(apart.abs().max()) == 1  # the old form fails these inputs


def test_a_one_level_change_on_a_boundary_is_caught() -> None:
    levels, clip = 7, 2.0
    mu = torch.tensor(0.8125)  # L / (clip * mu) = 7 / 1.625 rounds; the halves below are exact products
    scale = l1_scale(mu, levels, clip)
    c = (torch.arange(-levels, levels, dtype=torch.float32) + 0.5) / scale
    exact_halves = c * scale == torch.floor(c * scale) + 0.5
    assert int(exact_halves.sum()) >= 4  # enough values whose product is exactly k + 1/2
    expected = l1_quantize(c, levels, clip, mu)
    changed = rounded_half_away_from_zero(c, levels, clip, mu)
    assert torch.equal(quantize_l1(c, mu, levels, clip), expected)
    apart = (changed - expected).abs()
    assert int(apart.count_nonzero()) > 0 and int(apart.max()) == 1  # where the even neighbour is nearer 0
    assert not torch.equal(changed, expected)
    assert not apart[~exact_halves].any()


def on_boundaries_of_its_own_mean(numel: int, levels: int, clip: float, capacity: int, seed: int) -> Tensor:
    """A tensor whose own mu (summed chunk-wise past ``capacity``) puts a tenth of its values on boundaries.

    The boundary values depend on mu and mu on them: element 0 is a balancer that takes up what they add or
    remove. Where no balancer value brings the fp32 sums back to mu exactly, the values move to the mu reached
    and the balancer tries again (each round moves mu less: the boundary values hold about a tenth of the sum).
    The sums are torch's, as the optimizer's are, so the case is built for whatever order this CPU's vector
    width gives them; nothing asked of it depends on that order (see the test below)."""
    generator = torch.Generator().manual_seed(seed)
    c = torch.randn(numel, generator=generator)
    count = numel // 10
    c[0] = 4.0 * count
    where = torch.randperm(numel - 1, generator=generator)[:count] + 1
    halves, offsets = near_halves(levels, count, generator)
    mu = segment_mean_abs(c, capacity)
    for _ in range(20):
        c[where] = boundary_values(l1_scale(mu, levels, clip), halves, offsets)
        target = float(mu) * numel - float(c[1:].abs().double().sum())
        grain = float(mu) * numel * 2.0**-26  # under an ulp of the balancer: every fp32 value near target
        for step in range(-200, 200):
            c[0] = target + step * grain
            if torch.equal(segment_mean_abs(c, capacity), mu):
                return c
        c[0] = target
        mu = segment_mean_abs(c, capacity)
    raise AssertionError("no balancer value restores mu")  # the construction's own failure, not the library's


def stepped_levels(c: Tensor, levels: int, clip: float, mu: Tensor, form: Callable[..., Tensor]) -> Tensor:
    """Where a zero parameter ends after one step of lr 1 that applies the mean of one worker's levels: -q / L."""
    return -(form(c, levels, clip, mu).double() / levels).float()


@pytest.mark.parametrize(
    ("bits", "algorithm", "levels", "seed"),
    [(8, "allreduce", 127, 1), (4, "alltoall", 7, 2), (8, "alltoall", 127, 3)],
)
def test_lioncub_steps_the_references_levels_on_boundaries_of_a_tensor_cut_across_buckets(
    bits: int, algorithm: str, levels: int, seed: int
) -> None:
    # beta1 = 0: c is the gradient; lr 1, no decay, zero parameters: each parameter ends at -q / L, exactly.
    # w (2560 elements) spans three 1024-element buckets, so its mu is summed chunk-wise; b fits one bucket.
    clip, capacity = 2.0, 1024
    w = on_boundaries_of_its_own_mean(2560, levels, clip, capacity, seed=10 * seed)
    b = on_boundaries_of_its_own_mean(700, levels, clip, capacity, seed=10 * seed + 1)
    options = {"compression": "kbit", "bits": bits, "quantizer": "l1", "kbit_algorithm": algorithm}
    params = [nn.Parameter(torch.zeros(2560)), nn.Parameter(torch.zeros(700))]
    optimizer = LionCub(params, lr=1.0, betas=(0.0, 0.99), aggregation="mean", bucket_size=capacity, **options)
    for param, grad in zip(params, (w, b), strict=True):
        param.grad = grad.clone()
    optimizer.step()

    expected, _ = simulate_lioncub(
        [torch.zeros(2560), torch.zeros(700)],
        lambda rank, step, ps: [w.clone(), b.clone()],
        1,
        1,
        lr=1.0,
        betas=(0.0, 0.99),
        aggregation="mean",
        bucket_size=capacity,
        **options,
    )
    for got, want in zip(params, expected, strict=True):
        assert torch.equal(got.detach(), want)

    # Each half of the references' quantizer before fails these inputs on its own: the old form, and a mu of w
    # summed in another order than the optimizer's chunks (in one go, as the references did). Another order moves
    # mu by whole ulps or not at all; one ulp, either way, is the least, and these inputs tell even that from the
    # chunk-wise mu (a mu farther off moves more of them), on every CPU, whatever order its vector width gives.
    got_w = params[0].detach()
    chunked_mu = segment_mean_abs(w, capacity)
    assert not torch.equal(stepped_levels(w, levels, clip, chunked_mu, old_form), got_w)
    for toward in (torch.inf, -torch.inf):
        other_order_mu = torch.nextafter(chunked_mu, torch.tensor(toward))
        assert not torch.equal(stepped_levels(w, levels, clip, other_order_mu, l1_quantize), got_w), toward
