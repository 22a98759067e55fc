"""The clip a compressed mode runs by default, against plain torch: with a bin per element its factor is
``min(1, max_norm / (|mean of the ranks' gradients| + 1e-6))`` exactly, whatever the loss scale the gradients carry.

LionCub runs its real step on 2-4 ranks as threads (tests/support/thread_world.py: the same collectives' sums in
rank order as gloo; the gloo jobs of tests/distributed check the clip against the same plain loop on real
process groups). One parameter tensor, so that "a bin per element" holds: the sketch's bins restart at each
tensor's element 0 (ds_lioncub/step/clipping.py), and elements of two tensors may share a bin.
"""

from __future__ import annotations

import pytest
import torch

from ds_lioncub import LionCub
from tests.support.thread_world import ThreadLionCub, on_every_rank

ELEMENTS = 3_000
BINS = 4_093  # at least ELEMENTS: every element in a bin of its own
MAX_NORM = 0.5


def rank_gradient(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ELEMENTS, generator=generator) * 0.02 + 0.01 * (rank + 1)


def plain_factor(p: int, step: int) -> float:
    """The factor from the definition, in plain torch: the norm of the ranks' mean gradient, in fp64."""
    mean = sum(rank_gradient(rank, step).double() for rank in range(p)) / p
    return min(1.0, MAX_NORM / (float(torch.linalg.vector_norm(mean)) + 1e-6))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_with_a_bin_per_element_every_rank_scales_by_max_norm_over_the_norm_of_the_mean(p: int) -> None:
    steps = 3

    def run(transport: object) -> list[tuple[float | None, torch.Tensor]]:
        param = torch.nn.Parameter(torch.zeros(ELEMENTS))
        clip = {"max_norm": MAX_NORM, "sketch_bins": BINS}
        optimizer = ThreadLionCub(transport, [param], lr=1e-3, compression="1bit", clip=clip)  # type: ignore[arg-type]
        seen = []
        for step in range(1, steps + 1):
            gradient = rank_gradient(optimizer.transport.rank, step)
            param.grad = gradient.clone()
            optimizer.step()
            seen.append((optimizer.last_clip_coefficient, param.grad.clone()))
        return seen

    ranks = on_every_rank(p, run)
    for step in range(1, steps + 1):
        expected = plain_factor(p, step)
        assert expected < 1.0  # the clip binds: the test would see a factor of 1 applied by mistake
        for rank, seen in enumerate(ranks):
            factor, clipped = seen[step - 1]
            assert factor == pytest.approx(expected, rel=1e-12, abs=0), (rank, step)
            # The gradient LionCub stepped is this rank's own, scaled by that factor (fp32 product).
            assert torch.equal(clipped, rank_gradient(rank, step) * factor), (rank, step)


@pytest.mark.parametrize("loss_scale", [1.0, 2.0**16])
def test_a_loss_scaled_hybrid_shard_is_unscaled_exactly_once(loss_scale: float) -> None:
    """The ZeRO hybrids sketch the loss-scaled reduced shards before ZeRO unscales them (fp16's dynamic scale,
    e.g. 2**16) and give the factor to every part: it must be the unscaled gradient's, neither the scaled one's
    (the scale not divided out) nor the scale divided twice."""
    p = 2

    def run(transport: object) -> float | None:
        param = torch.nn.Parameter(torch.zeros(ELEMENTS))
        clip = {"max_norm": MAX_NORM, "sketch_bins": BINS}
        optimizer = ThreadLionCub(transport, [param], lr=1e-3, compression="1bit", clip=clip)  # type: ignore[arg-type]
        scaled = rank_gradient(optimizer.transport.rank, 1) * loss_scale  # a power of two: exact in fp32
        return optimizer.engine_side.sketch_step([[scaled]], optimizer.engine_side.next_step, loss_scale)

    factors = on_every_rank(p, run)
    assert factors == [pytest.approx(plain_factor(p, 1), rel=1e-12, abs=0)] * p


def test_in_python_nothing_clips_unless_clip_sets_a_norm() -> None:
    """As a torch optimizer clips nothing by itself: without option clip LionCub steps the gradient as it is."""
    param = torch.nn.Parameter(torch.zeros(ELEMENTS))
    optimizer = LionCub([param], lr=1e-3, compression="1bit")
    param.grad = rank_gradient(0, 1) * 100.0
    before = param.grad.clone()
    optimizer.step()
    assert optimizer.last_clip_coefficient is None and torch.equal(param.grad, before)
