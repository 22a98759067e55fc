"""The compiled packing kernels (ops/csrc) against the pure torch path, bit for bit.

The CPU op is built once per checkout (JIT, cached under build/torch_extensions) by the ``cpu_op`` fixture
(conftest.py at the repository root), the first time a test asks for it. A failed build FAILS these tests:
a compiler is always present where they run. CUDA tests are marked ``gpu`` and skip, with the reason,
where there is no CUDA device. The op builder and report are in test_op_builder.py, the choice of path
in test_dispatch.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub.comm.backend import CompressedBackend
from ds_lioncub.comm.quantize import l1_scale, quantize_l1

SIZES = (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 1000, 4099)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIDTHS = (1, 2, 4, 8)
LARGE = (1 << 20) + 13  # several parallel tasks, and a ragged end

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def on_both_paths(fn: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """fn on the compiled path and on the torch path; asserts the results are identical."""
    packing.set_packing_path("compiled")
    assert packing.packing_path(_device_of(args)).path == "compiled"
    compiled = fn(*args, **kwargs)
    packing.set_packing_path("torch")
    reference = fn(*args, **kwargs)
    packing.set_packing_path(None)
    assert compiled.dtype == reference.dtype, (compiled.dtype, reference.dtype)
    assert compiled.shape == reference.shape, (compiled.shape, reference.shape)
    assert compiled.device == reference.device
    if not torch.equal(compiled, reference):
        where = (compiled != reference).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{fn.__name__}: compiled and torch paths differ at {where}")
    return compiled


def _device_of(args: tuple) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


def signed_values(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values with exact zeros of both signs, NaN, infinities and tiny (subnormal) values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.25] = 0.0
    specials = [-0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, 0.0, -float("nan")]
    for i, value in enumerate(specials[: n // 4]):
        x[3 * i + 1] = value
    return x.to(dtype)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


# ------------------------------------------------------------------ signs


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.bool,))
def test_pack_signs(cpu_op, dtype: torch.dtype, zero_is_positive: bool, bits: int) -> None:
    for n in SIZES:
        x = signed_values(n, seed=n + bits)
        x = x > 0 if dtype == torch.bool else x.to(dtype)
        on_both_paths(packing.pack_signs, x, zero_is_positive, bits=bits)
        extra = packing.packed_length(n, bits) + 5
        padded = on_both_paths(packing.pack_signs, x, zero_is_positive, bits=bits, nbytes=extra)
        assert padded[packing.packed_length(n, bits) :].eq(0).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_pack_signs_large_and_of_views(cpu_op, dtype: torch.dtype) -> None:
    x = signed_values(LARGE, seed=1, dtype=dtype)
    for zero_is_positive in (True, False):
        on_both_paths(packing.pack_signs, x, zero_is_positive)
    on_both_paths(packing.pack_signs, x[3:1003], True)  # unaligned start
    on_both_paths(packing.pack_signs, x[::3][:999], False)  # strided
    on_both_paths(packing.pack_signs, x[:4096].view(64, 64).t(), True)  # non-contiguous 2-d


def test_pack_signs_rejects_a_short_nbytes(cpu_op) -> None:
    packing.set_packing_path("compiled")
    with pytest.raises(ValueError, match="smaller"):
        packing.pack_signs(torch.ones(17), nbytes=2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unpack_signs(cpu_op, dtype: torch.dtype) -> None:
    for n in SIZES + (LARGE,):
        packed = random_bytes(packing.packed_length(n) + 3, seed=n)  # garbage beyond numel is ignored
        out = on_both_paths(packing.unpack_signs, packed, n, dtype)
        assert out.abs().eq(1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_signs_streaming_stores(cpu_op, dtype: torch.dtype) -> None:
    # outputs of 16 MiB and more take the non-temporal store path (aligned) or the regular one
    n = (16 << 20) // (torch.finfo(dtype).bits // 8) + 13
    packed = random_bytes(packing.packed_length(n), seed=11)
    on_both_paths(packing.unpack_signs, packed, n, dtype)
    packing.set_packing_path("compiled")
    misaligned = torch.empty(n + 1, dtype=dtype)[1:]
    packing.packing_path("cpu").module.unpack_signs(packed, misaligned)
    packing.set_packing_path("torch")
    assert torch.equal(misaligned, packing.unpack_signs(packed, n, dtype))


def test_unpack_signs_of_other_dtypes_falls_back_exactly(cpu_op) -> None:
    packed = random_bytes(20, seed=3)
    on_both_paths(packing.unpack_signs, packed, 150, torch.float64)
    on_both_paths(packing.unpack_signs, packed, 150, torch.int8)


# ------------------------------------------------------------------ the fused vote and the counts


@pytest.mark.parametrize("zero_is_positive", [True, False])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 16, 33, 300])
def test_vote_packed_signs(cpu_op, p: int, zero_is_positive: bool) -> None:
    for n in SIZES[1:] + (((1 << 16) + 5,) if p < 100 else ()):
        rows = random_bytes(p * (packing.packed_length(n) + 2), seed=p * 7 + n).view(p, -1)
        vote = on_both_paths(packing.vote_packed_signs, rows, n, zero_is_positive)
        assert vote.numel() == packing.packed_length(n)
        on_both_paths(packing.vote_packed_signs, rows[:, 1:], n, zero_is_positive)  # non-contiguous rows


def test_vote_packed_signs_ties(cpu_op) -> None:
    # p = 4: rows 0b1111_0000 (x2) and 0b1100_1100 (x2): counts 2 (tie) / 4 / 0 per position.
    rows = torch.tensor([[0xF0], [0xF0], [0xCC], [0xCC]], dtype=torch.uint8)
    for path in ("compiled", "torch"):
        packing.set_packing_path(path)
        assert packing.vote_packed_signs(rows, 8, True).tolist() == [0b1111_1100]
        assert packing.vote_packed_signs(rows, 8, False).tolist() == [0b1100_0000]


def test_vote_of_a_large_stack(cpu_op) -> None:
    rows = random_bytes(4 * (LARGE // 8 + 1), seed=9).view(4, -1)
    for zero_is_positive in (True, False):
        on_both_paths(packing.vote_packed_signs, rows, LARGE, zero_is_positive)


@pytest.mark.parametrize("bits", WIDTHS)
def test_sum_fields_per_position(cpu_op, bits: int) -> None:
    for p in (1, 2, 3, 5, 17):
        for n in SIZES[1:]:
            rows = random_bytes(p * packing.packed_length(n, bits), seed=bits * 100 + p + n).view(p, -1)
            sums = on_both_paths(packing.sum_fields_per_position, rows, bits, n)
            assert sums.dtype == torch.int32
    rows = random_bytes(3 * packing.packed_length(LARGE, bits), seed=bits).view(3, -1)
    on_both_paths(packing.sum_fields_per_position, rows, bits, LARGE)
    on_both_paths(packing.count_set_bits_per_position, rows, LARGE * bits)


# ------------------------------------------------------------------ b-bit fields


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bool])
@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_fields(cpu_op, bits: int, dtype: torch.dtype) -> None:
    if dtype == torch.bool and bits != 1:
        pytest.skip("bool values are 1-bit fields")
    for n in SIZES + (LARGE,):
        g = torch.Generator().manual_seed(n * 10 + bits)
        values = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(dtype)
        on_both_paths(packing.pack_fields, values, bits)
        on_both_paths(packing.pack_fields, values, bits, nbytes=packing.packed_length(n, bits) + 2)
    buffer = torch.randint(0, 1 << bits, (300,), dtype=torch.int64).to(dtype)
    for start in (1, 3, 8):
        on_both_paths(packing.pack_fields, buffer[start : start + 64], bits)
    on_both_paths(packing.pack_fields, buffer[::3], bits)


@pytest.mark.parametrize("bits", WIDTHS)
def test_unpack_fields(cpu_op, bits: int) -> None:
    for n in SIZES + (LARGE,):
        packed = random_bytes(packing.packed_length(n, bits) + 2, seed=n + bits)
        on_both_paths(packing.unpack_fields, packed, bits, n)
        exact = packed[: packing.packed_length(n, bits)]  # no spare byte after the last field
        on_both_paths(packing.unpack_fields, exact, bits, n)


# ------------------------------------------------------------------ L1 quantize + pack


def _l1_cases(n: int) -> list[list[int]]:
    third = n // 3
    return [[n], [third, 0, n - 2 * third, third], [1] * min(n, 9) + [n - min(n, 9)]]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_l1_fields(cpu_op, bits: int, dtype: torch.dtype) -> None:
    top = (1 << bits) - 1
    for levels in sorted({1, top // 4 or 1, top // 2}):
        for n in SIZES:
            c = signed_values(n, seed=n + levels, dtype=dtype)
            for sizes in _l1_cases(n):
                scales = []
                start = 0
                for index, size in enumerate(sizes):
                    segment = c[start : start + size].float().nan_to_num(0, 0, 0)
                    mean = 0.0 if index == 1 or size == 0 else segment.abs().mean()
                    scales.append(l1_scale(mean, levels, 2.0))
                    start += size
                scales = torch.stack(scales)
                on_both_paths(packing.pack_l1_fields, c, scales, sizes, levels, bits)
                on_both_paths(
                    packing.pack_l1_fields, c, scales, sizes, levels, bits, nbytes=packing.packed_length(n, bits) + 1
                )


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_l1_fields_rounds_half_to_even(cpu_op, bits: int) -> None:
    # c * scale lands exactly on k + 0.5 (scale a power of two): round half to even decides.
    levels = ((1 << bits) - 1) // 2
    halves = torch.arange(-levels - 2, levels + 2, dtype=torch.float32) + 0.5
    c = torch.cat([halves * 4, halves * 4 + 1e-3, halves * 4 - 1e-3, torch.tensor([1e30, -1e30])])
    scale = torch.tensor([0.25])
    packed = on_both_paths(packing.pack_l1_fields, c, scale, [c.numel()], levels, bits)
    fields = packing.unpack_fields(packed, bits, c.numel()).to(torch.int32) - levels
    expected = torch.round(c * 0.25).clamp(-levels, levels).to(torch.int32)
    assert torch.equal(fields, expected)


def test_pack_l1_fields_equals_quantize_l1(cpu_op) -> None:
    """The fused quantizer matches quantize_l1 (the formula of record) followed by pack_fields."""
    levels, bits, clip = 7, 4, 2.0
    c = signed_values(5000, seed=4).nan_to_num(0.0, 3.0, -3.0)
    sizes = [1000, 0, 2500, 1500]
    means = [c[0:1000].abs().mean(), torch.tensor(0.0), c[1000:3500].abs().mean(), c[3500:].abs().mean()]
    q = torch.cat(
        [
            quantize_l1(c[s : s + n], m, levels, clip)
            for s, n, m in zip([0, 1000, 1000, 3500], sizes, means, strict=True)
        ]
    )
    expected = packing.pack_fields((q + levels).to(torch.uint8), bits)
    scales = torch.stack([l1_scale(m, levels, clip) for m in means])
    for path in ("compiled", "torch"):
        packing.set_packing_path(path)
        assert torch.equal(packing.pack_l1_fields(c, scales, sizes, levels, bits), expected), path


def test_pack_l1_fields_large(cpu_op) -> None:
    c = signed_values(LARGE, seed=5)
    sizes = [100_003, LARGE - 100_003]
    scales = torch.stack([l1_scale(0.8, 7, 2.0), l1_scale(1.3, 7, 2.0)])
    on_both_paths(packing.pack_l1_fields, c, scales, sizes, 7, 4)


# ------------------------------------------------------------------ the backend on both paths


def test_backend_results_do_not_depend_on_the_path(cpu_op) -> None:
    backend = CompressedBackend()  # a world of one
    update = signed_values(3001, seed=6).nan_to_num(0.0, 1.0, -1.0)
    cases = [("1bit", {})]
    for bits in (2, 4, 8):
        for quantizer in ("sign", "l1"):
            for algorithm in ("allreduce", "alltoall"):
                for aggregation in ("vote", "mean"):
                    cases.append(
                        ("kbit", dict(bits=bits, quantizer=quantizer, algorithm=algorithm, aggregation=aggregation))
                    )
    for step in (1, 2):
        for kind, options in cases:
            results = {}
            for path in ("compiled", "torch"):
                packing.set_packing_path(path)
                if kind == "1bit":
                    results[path] = backend.vote_1bit(update, step)
                else:
                    results[path] = backend.vote_kbit(update, step, segment_sizes=[1000, 2001], **options)
            assert torch.equal(results["compiled"], results["torch"]), (kind, options, step)


# ------------------------------------------------------------------ CUDA (skipped without a GPU)


def on_cuda_and_cpu_torch(fn: Callable[..., torch.Tensor], *args, **kwargs) -> None:
    """fn on CUDA tensors (compiled CUDA op) equals fn on CPU tensors (pure torch)."""
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    packing.set_packing_path("compiled")
    got = fn(*cuda_args, **kwargs).cpu()
    packing.set_packing_path("torch")
    expected = fn(*args, **kwargs)
    packing.set_packing_path(None)
    assert got.dtype == expected.dtype and torch.equal(got, expected), fn.__name__


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_match_the_torch_path(cuda_op) -> None:
    for n in SIZES + (LARGE,):
        for dtype in FLOAT_DTYPES:
            x = signed_values(n, seed=n, dtype=dtype)
            for zero_is_positive in (True, False):
                for bits in WIDTHS:
                    on_cuda_and_cpu_torch(
                        packing.pack_signs, x, zero_is_positive, bits=bits, nbytes=packing.packed_length(n, bits) + 3
                    )
            packed = random_bytes(packing.packed_length(n) + 1, seed=n)
            on_cuda_and_cpu_torch(packing.unpack_signs, packed, n, dtype)
        for p in (1, 2, 3, 4, 33):
            rows = random_bytes(p * (packing.packed_length(n) + 1), seed=p + n).view(p, -1)
            for zero_is_positive in (True, False):
                on_cuda_and_cpu_torch(packing.vote_packed_signs, rows, n, zero_is_positive)
        for bits in WIDTHS:
            values = random_bytes(n, seed=bits).bitwise_and_((1 << bits) - 1)
            on_cuda_and_cpu_torch(packing.pack_fields, values, bits)
            on_cuda_and_cpu_torch(packing.pack_fields, values.to(torch.int32), bits)
            on_cuda_and_cpu_torch(packing.unpack_fields, random_bytes(packing.packed_length(n, bits), seed=n), bits, n)
            rows = random_bytes(3 * packing.packed_length(n, bits), seed=n + bits).view(3, -1)
            on_cuda_and_cpu_torch(packing.sum_fields_per_position, rows, bits, n)
        for bits in (2, 4, 8):
            levels = ((1 << bits) - 1) // 2
            c = signed_values(n, seed=n + bits)
            sizes = [n // 2, n - n // 2]
            scales = torch.stack([l1_scale(1.0, levels, 2.0), l1_scale(0.0, levels, 2.0)])
            on_cuda_and_cpu_torch(packing.pack_l1_fields, c, scales, sizes, levels, bits)


@pytest.mark.gpu
@needs_cuda
def test_cupy_path_matches_the_torch_path() -> None:
    pytest.importorskip("cupy", reason="cupy is not installed")
    for n in SIZES:
        x = signed_values(n, seed=n)
        packing.set_packing_path("cupy")
        got = packing.pack_signs(x.cuda(), True).cpu()
        unpacked = packing.unpack_signs(got.cuda(), n).cpu()
        packing.set_packing_path("torch")
        assert torch.equal(got, packing.pack_signs(x, True))
        assert torch.equal(unpacked, packing.unpack_signs(got, n))
