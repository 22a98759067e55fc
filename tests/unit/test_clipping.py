"""Option ``clip``: the sketch against a plain scatter of every element, its estimate against the true norm, the
factor against DeepSpeed's formula, and LionCub and the virtual world against a plain loop."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ds_lioncub import LionCub
from ds_lioncub.comm import packing
from ds_lioncub.errors import LionCubConfigError, LionCubSetupError
from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder
from ds_lioncub.simulate import VirtualLionCub
from ds_lioncub.step import clipping, sketch
from ds_lioncub.step.clipping import clip_coefficient, gradient_sketch
from tests.support import scenarios as sc
from tests.support.clip_reference import brute_force_sketch, clipped_grads_fn, plain_sketch_and_squares
from tests.support.implementations import load_op_or_skip
from tests.support.reference import simulate_lioncub
from tests.support.scenario_optimizer import fresh_params, scenario_settings


def test_the_sketch_is_every_element_scattered_into_its_bin() -> None:
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) for shape in ((40, 64), (64,), (64, 8), (8,), (1,))]
    for bins in (1, 7, 61, 64, 4093):  # the function takes any width; the option refuses fewer than 256
        for step in (1, 2, 17):
            got = gradient_sketch([[g] for g in grads], bins, step, shard=0)
            assert torch.allclose(got, brute_force_sketch(grads, bins, step), rtol=1e-12, atol=1e-12), (bins, step)


def test_pieces_and_chunks_walk_the_same_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor given as pieces that start mid-row, walked in chunks of a few rows (the passes of a device other than
    the CPU) or by the CPU's kernel, sketches as the whole tensor."""
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    whole = brute_force_sketch([flat], 13, 5)
    monkeypatch.setattr(sketch, "CHUNK", 40)  # 3 rows of 13 per chunk
    pieces = [flat[:5], flat[5:6], flat[6:300], flat[300:]]
    for walk in (gradient_sketch, clipping.sketch_in_passes):
        assert torch.allclose(walk([pieces], 13, 5, shard=0), whole, rtol=1e-12, atol=1e-12), walk


def test_the_gpus_longer_chunks_walk_the_same_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunking a GPU takes (CUDA_CHUNK elements a pass, a table long enough for it), run on the CPU: the
    same sketch as the scatter, the table's windows read across its period."""
    monkeypatch.setattr(sketch, "_TABLES", {})
    monkeypatch.setattr(sketch, "chunk_for", lambda device: clipping.CUDA_CHUNK)
    table = clipping.sign_table(torch.device("cpu"))
    assert table.numel() == clipping.SIGN_PERIOD + clipping.CUDA_CHUNK
    assert torch.equal(table[clipping.SIGN_PERIOD :], table[: clipping.CUDA_CHUNK])
    flat = torch.randn(clipping.CUDA_CHUNK + 5 * 4093 + 17, generator=torch.Generator().manual_seed(7))
    for step in (1, 3):
        got = clipping.sketch_in_passes([[flat[:100]], [flat]], 4093, step, shard=0)
        want = brute_force_sketch([flat[:100], flat], 4093, step)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_on_a_gpu_the_sketch_is_the_scatter_and_the_same_bits_every_call() -> None:
    """On CUDA tensors (several chunks, a bf16 one, a short one) the sketch stays on the GPU, equals the CPU
    scatter, and repeats bit for bit: the ranks of a GPU job sum the same bits."""
    generator = torch.Generator().manual_seed(6)
    grads = [
        torch.randn(3 * clipping.CUDA_CHUNK + 12_345, generator=generator),
        torch.randn(5 * 4093 + 1, generator=generator).bfloat16(),
        torch.randn(77, generator=generator),
    ]
    on_gpu = [[g.cuda()] for g in grads]
    for step in (1, 9):
        got = gradient_sketch(on_gpu, 4093, step, shard=0)
        assert got.device.type == "cuda" and got.dtype == torch.float64
        assert torch.allclose(got.cpu(), brute_force_sketch(grads, 4093, step), rtol=1e-12, atol=1e-12), step
        assert torch.equal(got, gradient_sketch(on_gpu, 4093, step, shard=0)), step


def test_other_shards_and_tensors_draw_other_signs() -> None:
    g = torch.randn(500, generator=torch.Generator().manual_seed(3))
    base = gradient_sketch([[g]], 4093, 1, shard=0)
    assert not torch.equal(base, gradient_sketch([[g]], 4093, 1, shard=1))
    assert not torch.equal(base, gradient_sketch([[g]], 4093, 1, shard=0, first_tensor=1))
    assert not torch.equal(base, gradient_sketch([[g]], 4093, 2, shard=0))


# ---------------------------------------------------------------------- the CPU's order of the sums, bit for bit


@pytest.fixture(params=["compiled", "torch"])
def cpu_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU's sketch on the compiled kernel (skipped where the op does not build) and on its torch reference."""
    if request.param == "compiled":
        load_op_or_skip(LionCubPackingCPUBuilder())
    packing.set_packing_path(request.param)
    try:
        yield request.param
    finally:
        packing.set_packing_path(None)


def step_reading_near_the_end(tensor: int, within: int) -> int:
    """The first step at which tensor ``tensor`` (shard 0) starts reading the signs ``within`` of the table's end."""
    return next(s for s in range(1, 1 << 24) if clipping.sign_offset(s, tensor, 0) >= clipping.SIGN_PERIOD - within)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_on_a_cpu_the_sketch_and_the_squares_are_the_plain_loop_bit_for_bit(cpu_path: str, dtype: torch.dtype) -> None:
    """Odd sizes: pieces that start and end mid-row, several tensors, rows that read across the table's end."""
    generator = torch.Generator().manual_seed(8)
    a, b, c = (torch.randn(n, generator=generator).to(dtype) for n in (1000, 77, 1))
    a[::9] = 0.0
    tensors = [[a[:5], a[5:6], a[6:300], a[300:]], [b], [c]]
    near_the_end = step_reading_near_the_end(0, 150)
    for bins in (1, 7, 13, 61, 4093):
        for step, first_tensor in ((near_the_end, 0), (3, 5)):
            got = clipping.sketch_and_square_norm(tensors, bins, step, 0, first_tensor)
            want = plain_sketch_and_squares(tensors, bins, step, 0, first_tensor)
            assert torch.equal(got, want), (bins, step)
            assert torch.equal(clipping.gradient_sketch(tensors, bins, step, 0, first_tensor), want[:bins])


def test_on_a_cpu_adding_tensor_after_tensor_continues_each_bins_sum(cpu_path: str) -> None:
    generator = torch.Generator().manual_seed(9)
    tensors = [[torch.randn(n, generator=generator)] for n in (100, 33, 250)]
    sketch = torch.zeros(13, dtype=torch.float64)
    for t, pieces in enumerate(tensors):
        clipping.add_to_sketch(sketch, pieces, clipping.sign_offset(4, t, 2))
    assert torch.equal(sketch, plain_sketch_and_squares(tensors, 13, 4, shard=2)[:13])


def test_the_table_of_sign_bits_holds_the_tables_signs() -> None:
    table = clipping.sign_table(torch.device("cpu"))[: clipping.SIGN_PERIOD].numpy()
    bits = np.unpackbits(clipping.sign_bits_table(torch.device("cpu")).numpy(), bitorder="little")
    assert bits.size >= clipping.SIGN_PERIOD + 64
    plus = (table > 0).astype(np.uint8)
    assert np.array_equal(bits[: clipping.SIGN_PERIOD + 64], np.concatenate([plus, plus[:64]]))


def test_with_a_bin_per_element_the_estimate_is_the_norm() -> None:
    g = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    estimate = float(torch.linalg.vector_norm(gradient_sketch([[g]], 4093, 1, shard=0)))
    assert estimate == pytest.approx(float(torch.linalg.vector_norm(g.double())), rel=1e-12)


def test_the_squared_estimate_is_unbiased_with_the_predicted_spread() -> None:
    """Over 300 steps' signs, mean |S|^2 within 4 standard errors of |g|^2, and its spread near sqrt(2 / K)."""
    generator = torch.Generator().manual_seed(5)
    g = torch.randn(200_000, generator=generator) * torch.rand(200_000, generator=generator) ** 4  # heavy-tailed
    truth = float(g.double().square().sum())
    squares = torch.tensor([float(gradient_sketch([[g]], 4093, t, 0).square().sum()) / truth for t in range(1, 301)])
    spread = float(squares.std())
    assert abs(float(squares.mean()) - 1.0) < 4 * spread / math.sqrt(len(squares))
    assert 0.5 * math.sqrt(2 / 4093) < spread < 2 * math.sqrt(2 / 4093)


def test_the_factor_is_deepspeeds_formula_on_the_mean_sketch() -> None:
    summed = torch.tensor([3.0, 4.0], dtype=torch.float64)  # two voters: the mean sketch's norm is 2.5
    assert clip_coefficient(summed, 2, 1.0) == 1.0 / (2.5 + 1e-6)
    assert clip_coefficient(summed, 2, 10.0) == 1.0
    assert clip_coefficient(summed, 2, 0.1, loss_scale=5.0) == 0.1 / (0.5 + 1e-6)  # the unscaled norm is 0.5
    assert clip_coefficient(torch.tensor([math.nan, 1.0], dtype=torch.float64), 2, 1.0) == 1.0


@pytest.mark.parametrize("mode", ["clip-1bit", "clip-4bit-l1-alltoall", "clip-none"])
def test_the_virtual_world_equals_the_plain_loop(mode: str) -> None:
    """4 virtual workers (a world the distributed tier also runs on gloo ranks) against the plain loop."""
    p, options = 4, sc.clip_modes(4)[mode]
    settings = scenario_settings(**options)
    clip = settings.pop("clip")
    factors: list[float] = []
    grads = clipped_grads_fn(
        lambda rank, step, params: sc.model_grads(params, rank, step), p, clip["max_norm"], clip["sketch_bins"], factors
    )
    want, _ = simulate_lioncub(list(sc.init_params().values()), grads, p, sc.TRAIN_STEPS, **settings)
    params = fresh_params()
    virtual = VirtualLionCub(list(params.items()), workers=p, **scenario_settings(**options))
    got = []
    for step in range(1, sc.TRAIN_STEPS + 1):
        on_cpu = [param.detach().clone() for param in params.values()]
        virtual.step([sc.model_grads(on_cpu, rank, step) for rank in range(p)])
        got.append(virtual.last_clip_coefficient)
    assert got == pytest.approx(factors, rel=1e-12, abs=0)
    assert any(f < 1.0 for f in factors) and any(f == 1.0 for f in factors), factors  # some steps clip, some not
    for name, expected in zip(sc.PARAM_SHAPES, want, strict=True):
        assert torch.equal(params[name].detach(), expected), name


def test_alone_lioncub_clips_its_own_gradient_as_the_plain_loop() -> None:
    options = {"compression": "1bit", "clip": sc.CLIP}
    settings = scenario_settings(**options)
    clip = settings.pop("clip")
    factors: list[float] = []
    grads = clipped_grads_fn(
        lambda rank, step, params: sc.model_grads(params, rank, step), 1, clip["max_norm"], clip["sketch_bins"], factors
    )
    want, _ = simulate_lioncub(list(sc.init_params().values()), grads, 1, sc.TRAIN_STEPS, **settings)
    params = fresh_params()
    optimizer = LionCub(list(params.items()), **scenario_settings(**options))
    for step in range(1, sc.TRAIN_STEPS + 1):
        optimizer.zero_grad()
        sc.loss_of(params, 0, step).backward()
        optimizer.step()
        assert optimizer.last_clip_coefficient == pytest.approx(factors[step - 1], rel=1e-12, abs=0)
    assert all(f < 1.0 for f in factors)  # one rank's norm (1.07) is above 0.7 at every step
    for name, expected in zip(sc.PARAM_SHAPES, want, strict=True):
        assert torch.equal(params[name].detach(), expected), name


def test_a_step_in_parts_without_a_given_factor_is_refused() -> None:
    params = fresh_params()
    optimizer = LionCub(list(params.items()), compression="1bit", clip={"max_norm": 1.0})
    sc.loss_of(params, 0, 1).backward()
    with (
        optimizer.engine_side.optimizer_step_in_parts(),
        pytest.raises(LionCubSetupError, match="clip_coefficient_given"),
    ):
        optimizer.step()
    with optimizer.engine_side.clip_coefficient_given(0.5), optimizer.engine_side.optimizer_step_in_parts():
        before = {name: p.grad.clone() for name, p in params.items()}  # type: ignore[union-attr]
        optimizer.step()
    assert optimizer.last_clip_coefficient == 0.5
    assert all(torch.equal(params[name].grad, before[name] * 0.5) for name in params)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        # In Python there is no gradient_clipping to take the norm from.
        ({}, "Pass clip={'max_norm': 1.0}"),
        ({"max_norm": None}, "Pass clip={'max_norm': 1.0}"),
        ({"max_norm": 0}, "clip.max_norm=0: Input should be greater than 0"),
        ({"max_norm": 1.0, "sketch_bins": 0}, "clip.sketch_bins=0: fewer than 256 bins"),
        ({"max_norm": 1.0, "sketch_bins": 2}, "use at least 256, or leave out sketch_bins"),
        ({"max_norm": 1.0, "sketch_bins": (1 << 19) + 1}, "clip.sketch_bins=524289"),
        ({"max_norm": 1.0, "bins": 7}, "unknown option 'clip.bins'"),
        ({"rule": "deepspeed", "max_norm": 1.0}, "so max_norm would not be used; drop max_norm"),
        ({"rule": "exact"}, "clip.rule='exact'"),
        (False, 'To keep DeepSpeed\'s rule write "clip": {"rule": "deepspeed"}'),
        ("1.0", 'must be a block such as {"max_norm": 1.0}'),
    ],
)
def test_bad_clip_options_are_refused_naming_the_fix(clip: object, message: str) -> None:
    with pytest.raises(LionCubConfigError, match="^LionCub: ") as raised:
        LionCub([torch.nn.Parameter(torch.zeros(3))], clip=clip)
    assert message in str(raised.value)


def test_a_number_is_the_max_norm() -> None:
    """``"clip": 1.0`` reads as ``{"max_norm": 1.0}`` (the form a user tries first)."""
    optimizer = LionCub([torch.nn.Parameter(torch.zeros(3))], clip=0.5)
    assert optimizer.options.mean_clip is not None and optimizer.options.mean_clip.max_norm == 0.5
    assert optimizer.options.mean_clip.sketch_bins == 4093
