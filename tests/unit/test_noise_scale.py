"""The gradient noise scale (option ``telemetry.noise_scale``, ds_lioncub/step/noise_scale.py) in one process.

Against independent references: synthetic gradients whose true B_simple = tr(Sigma) / |G|^2 is known; McCandlish's
two-batch estimates computed here in plain torch from the exact mean gradient (the library sketches it); and
LionCub on thread ranks against the virtual world, bit for bit. The virtual world against real gloo ranks is in
tests/distributed/test_virtual_world_vs_ranks.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ds_lioncub import LionCub, LionCubConfigError
from ds_lioncub.comm import wire
from ds_lioncub.config.clip_rule import DEFAULT_SKETCH_BINS
from ds_lioncub.integration.wiring import voter_batch_samples
from ds_lioncub.simulate import VirtualLionCub
from ds_lioncub.simulate.noise_terms import exact_noise_terms
from ds_lioncub.step.clipping import sketch_and_square_norm
from ds_lioncub.step.noise_scale import NoiseScale, step_estimates
from ds_lioncub.telemetry import StepRecord
from tests.support.thread_world import ThreadLionCub, on_every_rank

DIMENSIONS = 2000
#: More elements than the default sketch's bins, so that elements share bins and the sketch has an error at all.
MANY = 5 * DEFAULT_SKETCH_BINS


def synthetic_problem(
    seed: int, true_b_simple: float, dimensions: int = DIMENSIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    """A true gradient G and per-sample noise standard deviations s (Sigma = diag(s^2)), with
    tr(Sigma) / |G|^2 = ``true_b_simple`` samples."""
    generator = torch.Generator().manual_seed(seed)
    std = torch.linspace(0.5, 1.5, dimensions, dtype=torch.float64)
    direction = torch.randn(dimensions, generator=generator, dtype=torch.float64)
    gradient = direction * math.sqrt(float(std.square().sum()) / true_b_simple) / direction.norm()
    return gradient, std


def voter_gradients(
    gradient: torch.Tensor, std: torch.Tensor, voters: int, batch: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """Each voter's gradient: G plus the mean of ``batch`` samples' Gaussian noise of covariance diag(std^2)."""
    noise = torch.randn(voters, batch, gradient.numel(), generator=generator, dtype=torch.float64) * std
    return [(gradient + noise[i].mean(0)).float() for i in range(voters)]


def test_the_estimate_lands_within_ten_percent_of_the_true_noise_scale() -> None:
    """8 voters of 4 samples, true B_simple 64 samples (twice the global batch), 200 steps at beta 0.99: over 12
    seeds the smoothed estimate's error had an sd of 0.6% at 400 steps (each step's |G|^2 estimate strays ~13%),
    so 10% is far outside what a seed can do."""
    voters, batch, true_b_simple = 8, 4, 64.0
    gradient, std = synthetic_problem(0, true_b_simple)
    param = torch.nn.Parameter(torch.zeros(DIMENSIONS))
    optimizer = VirtualLionCub([param], workers=voters, lr=1e-6, compression="1bit")
    optimizer.set_noise_scale_batch(batch)
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        optimizer.step([[grad] for grad in voter_gradients(gradient, std, voters, batch, generator)])
    measured = optimizer.noise_scale
    assert measured is not None and measured.steps == 200 and measured.voters == voters
    assert measured.b_simple is not None and measured.b_simple_voter_batches is not None
    assert measured.b_simple == pytest.approx(true_b_simple, rel=0.10)
    assert measured.b_simple == pytest.approx(measured.b_simple_voter_batches * batch, rel=1e-12)
    assert measured.gradient_square == pytest.approx(float(gradient.square().sum()), rel=0.10)
    assert measured.trace_sigma == pytest.approx(float(std.square().sum()), rel=0.10)


@pytest.mark.parametrize("clip", [None, {"max_norm": 1e6, "sketch_bins": 509}], ids=["noise-alone", "with-clip"])
def test_each_steps_sketched_estimate_matches_the_exact_one_within_the_sketchs_spread(
    clip: dict[str, float] | None,
) -> None:
    """beta 0: the record is each step's own estimate. The exact one uses |mean gradient|^2 computed in plain torch
    and McCandlish's formulas with b and B in samples; the sketch's |G_B|^2 has a relative sd of about sqrt(2/K),
    which the estimates inherit scaled by B/(B - b) and 1/(1/b - 1/B): allowed 5 sd, every step."""
    voters, batch = 6, 3
    big_batch = voters * batch
    bins = DEFAULT_SKETCH_BINS if clip is None else int(clip["sketch_bins"])
    gradient, std = synthetic_problem(2, 10.0, MANY)
    param = torch.nn.Parameter(torch.zeros(MANY))
    options = {} if clip is None else {"clip": clip}
    optimizer = VirtualLionCub(
        [param], workers=voters, lr=1e-6, compression="1bit", telemetry={"noise_scale_beta": 0.0}, **options
    )
    optimizer.set_noise_scale_batch(batch)
    generator = torch.Generator().manual_seed(3)
    deviations = []
    for _ in range(20):
        grads = voter_gradients(gradient, std, voters, batch, generator)
        small = sum(float(g.double().square().sum()) for g in grads) / voters
        big = float(torch.stack([g.double() for g in grads]).mean(0).square().sum())
        exact_square = (big_batch * big - batch * small) / (big_batch - batch)
        exact_trace = (small - big) / (1 / batch - 1 / big_batch)
        optimizer.step([[grad] for grad in grads])
        measured = optimizer.noise_scale
        assert measured is not None and measured.trace_sigma is not None
        spread = math.sqrt(2 / bins) * big
        assert abs(measured.gradient_square - exact_square) <= 5 * spread * big_batch / (big_batch - batch)
        assert abs(measured.trace_sigma - exact_trace) <= 5 * spread / (1 / batch - 1 / big_batch)
        deviations.append(abs(measured.gradient_square - exact_square) / (spread * big_batch / (big_batch - batch)))
    assert max(deviations) > 0.05  # the sketch, not the exact mean: its error is there, at its expected size
    if clip is not None:
        assert optimizer.last_clip_coefficient == 1.0


def test_the_loss_scale_divides_out() -> None:
    generator = torch.Generator().manual_seed(4)
    grads = [torch.randn(500, generator=generator, dtype=torch.float64) + 0.3 for _ in range(3)]
    summed = sum(sketch_and_square_norm([[g]], 257, 1, 0) for g in grads)
    scaled = sum(sketch_and_square_norm([[g * 1024.0]], 257, 1, 0) for g in grads)
    assert isinstance(summed, torch.Tensor) and isinstance(scaled, torch.Tensor)
    plain, unscaled = step_estimates(summed, 3), step_estimates(scaled, 3, loss_scale=1024.0)
    assert plain is not None and unscaled is not None
    assert unscaled == pytest.approx(plain, rel=1e-12)
    assert step_estimates(summed * math.inf, 3) is None  # an overflowed step is left out


def thread_rank_noise(
    p: int, steps: int, **options: object
) -> list[tuple[list[NoiseScale | None], list[StepRecord], int, LionCub]]:
    """``steps`` steps of LionCub on p thread ranks, rank r's gradient from seed 10 * step + r: every rank's
    noise scale and step record after each step, and its bytes sent."""

    def run(transport: object) -> tuple[list[NoiseScale | None], list[StepRecord], int, LionCub]:
        param = torch.nn.Parameter(torch.zeros(DIMENSIONS))
        optimizer = ThreadLionCub(transport, [param], lr=1e-6, **options)  # type: ignore[arg-type]
        noise, records = [], []
        for step in range(1, steps + 1):
            rank = optimizer.transport.rank
            param.grad = rank_gradient(rank, step)
            optimizer.step()
            noise.append(optimizer.noise_scale)
            assert optimizer.last_step_telemetry is not None
            records.append(optimizer.last_step_telemetry)
        return noise, records, optimizer.comm_stats().bytes_sent, optimizer

    return on_every_rank(p, run)


def rank_gradient(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(DIMENSIONS, generator=generator) * 0.5 + 0.2


def test_lioncub_on_thread_ranks_equals_the_virtual_world_and_reports_it() -> None:
    p, steps = 3, 4
    ranks = thread_rank_noise(p, steps, compression="1bit")
    param = torch.nn.Parameter(torch.zeros(DIMENSIONS))
    virtual = VirtualLionCub([param], workers=p, lr=1e-6, compression="1bit")
    for step in range(1, steps + 1):
        virtual.step([[rank_gradient(rank, step)] for rank in range(p)])
        expected = virtual.noise_scale
        assert expected is not None and expected.steps == step and expected.batch_samples is None
        for noise, records, _, _ in ranks:
            assert noise[step - 1] == expected  # the same summed bits, the same estimate
            record = records[step - 1]
            assert record.noise_scale is None  # samples per voter batch unknown in plain Python
            assert record.noise_scale_voter_batches == expected.b_simple_voter_batches
    events = dict(ranks[0][1][-1].monitor_events())
    assert events["LionCub/noise_scale_voter_batches"] == ranks[0][0][-1].b_simple_voter_batches  # type: ignore[union-attr]
    assert "LionCub/noise_scale" not in events
    optimizer = ranks[0][3]
    optimizer.set_noise_scale_batch(16)
    measured = optimizer.noise_scale
    assert measured is not None and measured.b_simple_voter_batches is not None
    assert measured.b_simple == measured.b_simple_voter_batches * 16


def test_the_noise_scales_all_reduce_is_counted_and_absent_where_it_is_not_measured() -> None:
    """As many collectives per step as with the option off: its fp64 all-reduce of bins + 1 numbers carries the
    non-finite check's verdict too (one more number), which the option off sends alone (an int32 all-reduce). None
    with compression "none" (no voter's own gradient), and no estimate at a world of one."""
    p, steps = 2, 2
    on = thread_rank_noise(p, steps, compression="1bit")
    off = thread_rank_noise(p, steps, compression="1bit", telemetry={"noise_scale": False})
    extra = wire.all_reduce_bytes(8 * (DEFAULT_SKETCH_BINS + 2), p) - wire.all_reduce_bytes(4, p)
    for (_, records_on, sent_on, _), (noise_off, records_off, sent_off, _) in zip(on, off, strict=True):
        assert sent_on == sent_off + steps * extra
        assert [r.collectives for r in records_on] == [r.collectives for r in records_off]
        assert noise_off == [None] * steps
    exact = thread_rank_noise(p, steps, compression="none")
    assert all(noise == [None] * steps for noise, _, _, _ in exact)
    assert all(record.noise_scale_voter_batches is None for _, records, _, _ in exact for record in records)
    param = torch.nn.Parameter(torch.zeros(8))
    alone = LionCub([param], compression="1bit")
    param.grad = torch.ones(8)
    alone.step()
    assert alone.noise_scale is None and alone.comm_stats().collectives == 0


def test_the_batch_per_voter_is_a_positive_integer_and_comes_from_the_engine() -> None:
    optimizer = LionCub([torch.nn.Parameter(torch.zeros(3))], compression="1bit")
    for bad in (0, -2, True, 2.5):
        with pytest.raises(LionCubConfigError, match=r"^LionCub: the samples per voter batch must be"):
            optimizer.set_noise_scale_batch(bad)  # type: ignore[arg-type]
    engine = SimpleNamespace(train_micro_batch_size_per_gpu=lambda: 4, gradient_accumulation_steps=lambda: 3)
    assert voter_batch_samples(engine, 1) == 12
    assert voter_batch_samples(engine, 8) == 96  # under the hybrid a voter is a node of 8 ranks


def test_the_moving_average_weight_is_validated() -> None:
    for bad in (1.0, -0.1, 2):
        with pytest.raises(LionCubConfigError, match="telemetry.noise_scale_beta"):
            LionCub([torch.nn.Parameter(torch.zeros(3))], telemetry={"noise_scale_beta": bad})


def test_the_virtual_worlds_exact_terms_are_mccandlishs_two_batch_estimates_over_several_tensors() -> None:
    """:func:`exact_noise_terms` (the study's B_simple, no sketch) against McCandlish's formulas computed here in
    plain Python from each worker's gradient split over two tensors; a non-finite gradient gives None."""
    voters, batch = 5, 2
    big_batch = voters * batch
    gradient, std = synthetic_problem(4, 7.0)
    grads = voter_gradients(gradient, std, voters, batch, torch.Generator().manual_seed(5))
    split = [[g[:1200].reshape(40, 30), g[1200:]] for g in grads]
    small = sum(float(g.double().square().sum()) for g in grads) / voters
    big = float(sum(g.double() for g in grads).div(voters).square().sum())
    exact_square = (big_batch * big - batch * small) / (big_batch - batch)
    exact_trace_per_sample = (small - big) / (1 / batch - 1 / big_batch)
    terms = exact_noise_terms(split)
    assert terms is not None
    assert terms[0] == pytest.approx(exact_square, rel=1e-9)
    assert terms[1] * batch == pytest.approx(exact_trace_per_sample, rel=1e-9)  # a worker's covariance is Sigma / b
    # The study's reading, B_simple in samples.
    assert batch * terms[1] / terms[0] == pytest.approx(exact_trace_per_sample / exact_square, rel=1e-9)
    split[2][1][3] = float("nan")
    assert exact_noise_terms(split) is None
