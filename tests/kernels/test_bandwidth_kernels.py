"""The second generation of kernels and operations, bit for bit against the torch path.

On every machine (CPU): the two operations v2 added (``vote_field_sums``, ``pack_l1_fields_of_means``) against
their definitions on every CPU implementation, the torch way of summing the sketch in the element order on a GPU
without the kernel (``device_sketch.scan_sketch_and_squares``) against the reference, the generation switch
(``DS_LIONCUB_CUDA_KERNELS``) and where the sketch takes which path.

On a CUDA device (marked ``gpu``; skipped, with the reason, elsewhere): every new kernel of
``ops/csrc/cuda/lioncub_bandwidth_kernels.cu`` against the torch path and against the first generation, on the
sizes, alignments and layouts its code takes different branches for (whole and partial warps' chunks, rows whose
length is or is not a multiple of 16 and 4 bytes, outputs and inputs that start off alignment, every bit-plane
count of the vote, thresholds outside the sums' range, the sketch's tiles, pieces smaller than a row and pieces
of every dtype), the sketch against the CPU's own bits, and the self-check of the op.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub.comm.packing import device_sketch
from ds_lioncub.comm.packing.torch_impl import TorchPacking
from ds_lioncub.comm.quantize import l1_segment_scales
from ds_lioncub.kernels import compiled
from ds_lioncub.kernels.compiled import CompiledPacking, kernel_generation
from tests.support.implementations import Implementation

TORCH = TorchPacking()
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=generator(seed), dtype=torch.int64).to(torch.uint8)


def signed_values(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values with zeros of both signs, NaN, infinities and subnormals."""
    x = torch.randn(n, generator=generator(seed)) * 3
    x[torch.rand(n, generator=generator(seed + 1)) < 0.2] = 0.0
    for i, value in enumerate((-0.0, math.nan, math.inf, -math.inf, 1e-40, -1e-40, -math.nan)[: n // 3]):
        x[3 * i + 1] = value
    return x.to(dtype)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal element for element (floats: bit for bit, any NaN as any NaN)."""
    got, want = got.cpu(), want.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_floating_point:
        nan = got.isnan()
        return torch.equal(nan, want.isnan()) and torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))
    return torch.equal(got, want)


# ====================================================================== on every machine


def test_vote_field_sums_is_the_sums_compared(impl: Implementation) -> None:
    for bits in (1, 2, 4, 8):
        top = (1 << bits) - 1
        for p in (1, 2, 5, 17):
            for n, extra in ((1029, 3), (2048, 0), (5, 0)):
                row_bytes = packing.packed_length(n, bits) + extra
                rows = random_bytes(p * row_bytes, seed=10 * p + bits).view(p, row_bytes)
                sums = TORCH.sum_fields_per_position(rows, bits, n)
                for threshold in (-5, 0, 1, p * top // 2, p * top, p * top + 1, 10_000):
                    want = TORCH.pack_fields(sums >= threshold, 1, packing.packed_length(n))
                    got = packing.vote_field_sums(impl.put(rows), bits, n, threshold)
                    assert torch.equal(got.cpu(), want), (bits, p, n, threshold)


def test_vote_field_sums_refuses_short_rows() -> None:
    with pytest.raises(ValueError, match="hold fewer than 100 4-bit fields"):
        packing.vote_field_sums(torch.zeros(2, 49, dtype=torch.uint8), 4, 100, 3)
    with pytest.raises(ValueError, match="at least one row"):
        packing.vote_field_sums(torch.zeros(0, 49, dtype=torch.uint8), 4, 10, 3)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_l1_fields_of_means_are_the_l1_fields_of_their_scales(impl: Implementation, dtype: torch.dtype) -> None:
    c = signed_values(3000, seed=3, dtype=dtype).nan_to_num(0.0, math.inf, -math.inf)
    sizes = [0, 7, 1000, 1, 0, 992, 1000]
    means = torch.tensor([0.3, 0.0, 1.7, math.nan, -2.0, 1e-45, 4e-39], dtype=torch.float32)
    for bits in (2, 4, 8):
        levels = ((1 << bits) - 1) // 2
        for clip in (2.0, 0.37):
            _, scales = l1_segment_scales(c, levels, clip, sizes, means)
            want = TORCH.pack_l1_fields(c, scales, sizes, levels, bits, packing.packed_length(c.numel(), bits) + 5)
            got = packing.pack_l1_fields_of_means(
                impl.put(c), impl.put(means), sizes, levels, clip, bits, nbytes=want.numel()
            )
            assert torch.equal(got.cpu(), want), (bits, clip)


def test_l1_fields_of_means_refuse_a_layout_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="2 segment sizes \\(total 10\\) and 3 means"):
        packing.pack_l1_fields_of_means(torch.zeros(10), [1.0, 1.0, 1.0], [5, 5], 1, 2.0, 2)


LAYOUTS = ((2, 7), (13, 61), (100, 1031), (4093, 61), (257, 1_048_573), (4093, 1_048_573))


def sketch_case(bins: int, period: int, seed: int) -> tuple[list[torch.Tensor], list[int], list[int], torch.Tensor]:
    """Pieces of every float dtype (a tensor in pieces that start and end mid-row, then two more tensors, one of
    several rows), each piece's first bin and table position, and the packed table."""
    bits = torch.randint(0, 2, (period,), generator=generator(period))
    signs = packing.pack_signs(bits[torch.arange(period + 64) % period].bool())  # the first 64 bits repeated
    sizes = ((5, 1, 13, 300, 2), (77,), (3 * bins + 11,))
    pieces, columns, starts = [], [], []
    for t, tensor_sizes in enumerate(sizes):
        position = 0
        for k, size in enumerate(tensor_sizes):
            pieces.append(signed_values(size, seed=seed + 7 * t + k, dtype=FLOAT_DTYPES[(t + k) % 3]))
            columns.append(position % bins)
            starts.append((period - 3 + 1000 * t + position) % period)
            position += size
    return pieces, columns, starts, signs


@pytest.mark.parametrize(("bins", "period"), LAYOUTS)
def test_the_scan_sums_in_the_element_order(bins: int, period: int) -> None:
    pieces, columns, starts, signs = sketch_case(bins, period, seed=bins)
    initial = torch.randn(bins + 1, generator=generator(bins), dtype=torch.float64)
    want, got = initial.clone(), initial.clone()
    TORCH.sketch_and_squares(pieces, columns, starts, signs, period, want)
    device_sketch.scan_sketch_and_squares(pieces, columns, starts, signs, period, got)
    assert same_bits(got, want)


def test_the_scan_of_many_rows_and_of_bins_that_start_at_minus_zero() -> None:
    period = 1_048_573
    pieces, columns, starts, signs = sketch_case(4093, period, seed=1)
    big = torch.randn((1 << 21) + 5, generator=generator(2))  # several cumsum windows
    pieces, columns, starts = [*pieces, big], [*columns, 0], [*starts, 12345]
    for initial in (torch.zeros(4094, dtype=torch.float64), torch.full((4094,), -0.0, dtype=torch.float64)):
        want, got = initial.clone(), initial.clone()
        TORCH.sketch_and_squares(pieces, columns, starts, signs, period, want)
        device_sketch.scan_sketch_and_squares(pieces, columns, starts, signs, period, got)
        assert same_bits(got, want)


def test_the_sketch_sums_in_the_element_order_unless_v1_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compiled.KERNELS_ENV, raising=False)
    assert kernel_generation() == "v2"
    assert device_sketch.sums_in_element_order(torch.device("cpu"))
    assert device_sketch.sums_in_element_order(torch.device("cuda"))
    monkeypatch.setenv(compiled.KERNELS_ENV, "v1")
    assert kernel_generation() == "v1"
    assert device_sketch.sums_in_element_order(torch.device("cpu"))  # a CPU's order never changes
    assert not device_sketch.sums_in_element_order(torch.device("cuda"))


class FakeCudaOp:
    """A stand-in for the CUDA op's names: which function each generation takes."""

    device = "cuda"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return name


def test_the_generation_switch_takes_the_first_kernels_and_leaves_the_new_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(compiled.KERNELS_ENV, raising=False)
    second = CompiledPacking(FakeCudaOp(), TORCH)
    assert [second.kernel(name) for name in ("pack_signs", "vote_field_sums", "sketch_and_squares")] == [
        "pack_signs",
        "vote_field_sums",
        "sketch_and_squares",
    ]
    monkeypatch.setenv(compiled.KERNELS_ENV, "v1")
    first = CompiledPacking(FakeCudaOp(), TORCH)
    assert [first.kernel(name) for name in compiled.FIRST_GENERATION] == [
        f"{name}_v1" for name in compiled.FIRST_GENERATION
    ]
    assert [first.kernel(name) for name in compiled.SECOND_GENERATION_ONLY] == [None] * 3
    assert first.kernel("pack_fields") == "pack_fields"


def test_the_cpu_op_is_the_same_under_either_generation(cpu_op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.KERNELS_ENV, "v1")
    ops = CompiledPacking(cpu_op, TORCH)
    assert ops.generation == "v2" and ops.kernel("sketch_and_squares") is cpu_op.sketch_and_squares


def test_a_cpu_sketch_still_goes_through_the_packing_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(packing, "sketch_and_squares", lambda *args: called.append(args))
    out = torch.zeros(8, dtype=torch.float64)
    device_sketch.add_sketch_and_squares([torch.ones(3)], [0], [0], torch.zeros(9, dtype=torch.uint8), 7, out)
    assert len(called) == 1


# ====================================================================== on a CUDA device


def on_device(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``x`` on the GPU, starting ``offset`` elements into a larger allocation (an unaligned start)."""
    if offset == 0:
        return x.cuda()
    holder = torch.empty(x.numel() + offset, dtype=x.dtype, device="cuda")
    view = holder[offset:]
    view.copy_(x)
    return view


SIGN_SIZES = (0, 1, 31, 32, 33, 1023, 1024, 1025, 4096 + 7, 65536, (1 << 20) + 3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", (*FLOAT_DTYPES, torch.bool, torch.uint8), ids=str)
def test_cuda_pack_signs_second_generation(cuda_op: Any, dtype: torch.dtype) -> None:
    for n in SIGN_SIZES:
        x = signed_values(n, seed=n, dtype=torch.float32)
        x = (x > 0) if dtype == torch.bool else ((x > 0).to(torch.uint8) if dtype == torch.uint8 else x.to(dtype))
        for bits in (1, 2, 4, 8):
            for zip_ in (True, False):
                for pad in (0, 3, 17):
                    nbytes = packing.packed_length(n, bits) + pad
                    # uint8 0/1 reaches the kernel as a bool does (compiled.py sends other uint8 to torch)
                    want = TORCH.pack_signs(x.bool() if dtype == torch.uint8 else x, zip_, bits, nbytes)
                    for x_offset, out_offset in ((0, 0), (1, 0), (0, 1), (0, 4), (3, 5)):
                        out = on_device(torch.full((nbytes,), 0xAB, dtype=torch.uint8), out_offset)
                        cuda_op.pack_signs(on_device(x, x_offset), zip_, bits, out)
                        assert torch.equal(out.cpu(), want), (n, bits, zip_, pad, x_offset, out_offset)
                        old = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                        cuda_op.pack_signs_v1(on_device(x, x_offset), zip_, bits, old)
                        assert torch.equal(old.cpu(), want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_unpack_signs_second_generation(cuda_op: Any, dtype: torch.dtype) -> None:
    for n in SIGN_SIZES:
        packed = random_bytes(packing.packed_length(n) + 3, seed=n)
        want = TORCH.unpack_signs(packed, n, dtype, None)
        for packed_offset, out_offset in ((0, 0), (1, 0), (0, 1), (2, 3)):
            out = on_device(torch.full((n,), 7, dtype=dtype), out_offset)
            cuda_op.unpack_signs(on_device(packed, packed_offset), out)
            assert same_bits(out, want), (n, packed_offset, out_offset)


VOTERS = (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64, 255, 256, 1000)


@pytest.mark.gpu
@needs_cuda
def test_cuda_vote_second_generation(cuda_op: Any) -> None:
    for p in VOTERS:
        for numel, extra in ((1029, 0), (1024 * 8, 0), (1024 * 8, 4), (1024 * 8 + 8, 3), (13, 1)):
            row_bytes = packing.packed_length(numel) + extra
            rows = random_bytes(p * row_bytes, seed=1000 * p + numel + extra).view(p, row_bytes)
            for zip_ in (True, False):
                want = TORCH.vote_packed_signs(rows, numel, zip_)
                for offset in (0, 1, 4):
                    got = torch.empty(want.numel(), dtype=torch.uint8, device="cuda")
                    cuda_op.vote_packed_signs(on_device(rows.reshape(-1), offset).view(p, row_bytes), numel, zip_, got)
                    assert torch.equal(got.cpu(), want), (p, numel, extra, zip_, offset)
                old = torch.empty(want.numel(), dtype=torch.uint8, device="cuda")
                cuda_op.vote_packed_signs_v1(rows.cuda(), numel, zip_, old)
                assert torch.equal(old.cpu(), want)
                padded = torch.full((want.numel() + 21,), 0xFF, dtype=torch.uint8, device="cuda")
                cuda_op.vote_packed_signs(rows.cuda(), numel, zip_, padded)  # the bytes past the positions: 0
                assert torch.equal(padded.cpu(), torch.cat([want, torch.zeros(21, dtype=torch.uint8)]))


@pytest.mark.gpu
@needs_cuda
def test_cuda_vote_field_sums(cuda_op: Any) -> None:
    for bits in (1, 2, 4, 8):
        top = (1 << bits) - 1
        for p in (1, 2, 3, 4, 17, 64):
            for numel, extra in ((1029, 1), (4096, 0), (4096, 8), (33, 0)):
                row_bytes = packing.packed_length(numel, bits) + extra
                rows = random_bytes(p * row_bytes, seed=100 * p + bits + extra).view(p, row_bytes)
                sums = TORCH.sum_fields_per_position(rows, bits, numel)
                for threshold in (-1, 0, 1, p * top // 2, p * top // 2 + 1, p * top, p * top + 1):
                    want = TORCH.pack_fields(sums >= threshold, 1, packing.packed_length(numel))
                    for offset in (0, 3):
                        got = torch.empty(want.numel(), dtype=torch.uint8, device="cuda")
                        device_rows = on_device(rows.reshape(-1), offset).view(p, row_bytes)
                        cuda_op.vote_field_sums(device_rows, bits, numel, threshold, got)
                        assert torch.equal(got.cpu(), want), (bits, p, numel, extra, threshold, offset)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_l1_scales_from_means(cuda_op: Any, dtype: torch.dtype) -> None:
    n = 40_000
    c = (signed_values(n, seed=5).nan_to_num(0.0, math.inf, -math.inf) * 2).to(dtype)
    sizes = [0, 9, 13_000, 1, 0, 20_000, n - 33_010]
    means = torch.tensor([0.2, 0.0, 0.71, math.nan, -1.0, 1e-45, 3e-39], dtype=torch.float32)
    means[2] = c[9:13_009].float().abs().mean()  # a mean as the optimizer takes it
    for bits in (2, 4, 8):
        for levels in sorted({1, ((1 << bits) - 1) // 2}):
            for clip in (2.0, 1.0, 0.3):
                # the scales as the torch path computes them on the GPU (means on the device)
                _, scales = l1_segment_scales(c.cuda(), levels, clip, sizes, means.cuda())
                want = TORCH.pack_l1_fields(c, scales, sizes, levels, bits, packing.packed_length(n, bits) + 3)
                for offset in (0, 1):
                    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], device="cuda")
                    got = torch.empty(want.numel(), dtype=torch.uint8, device="cuda")
                    cuda_op.quantize_l1_means_pack(on_device(c, offset), offsets, means.cuda(), levels, clip, bits, got)
                    assert torch.equal(got.cpu(), want), (bits, levels, clip, offset)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("bins", "period"), (*LAYOUTS, (1, 7), (32, 31), (33, 1031), (4093 * 2, 61)))
def test_cuda_sketch_is_the_cpus(cuda_op: Any, bins: int, period: int) -> None:
    pieces, columns, starts, signs = sketch_case(bins, period, seed=bins + period)
    big = signed_values(300 * bins + 17, seed=9)  # several tiles of 120 rows (the reference adds row by row)
    pieces, columns, starts = [*pieces, big.to(torch.bfloat16), big], [*columns, 0, 5 % bins], [*starts, 3, period - 1]
    for initial in (
        torch.randn(bins + 1, generator=generator(bins), dtype=torch.float64),
        torch.full((bins + 1,), -0.0, dtype=torch.float64),
    ):
        want = initial.clone()
        TORCH.sketch_and_squares(pieces, columns, starts, signs, period, want)
        got = initial.cuda()
        cuda_op.sketch_and_squares([p.cuda() for p in pieces], columns, starts, signs.cuda(), period, got)
        assert same_bits(got, want), (bins, period)
        reference = initial.cuda()
        TORCH.sketch_and_squares([p.cuda() for p in pieces], columns, starts, signs.cuda(), period, reference)
        assert same_bits(reference, want)  # the torch reference on the GPU: the CPU's bits too
        scanned = initial.cuda()
        device_sketch.scan_sketch_and_squares(
            [p.cuda() for p in pieces], columns, starts, signs.cuda(), period, scanned
        )
        assert same_bits(scanned, want)  # the GPU's cumsum adds a column's rows one after another


@pytest.mark.gpu
@needs_cuda
def test_cuda_sketch_of_no_piece_and_of_empty_pieces(cuda_op: Any) -> None:
    signs = packing.pack_signs(torch.randint(0, 2, (61 + 64,), generator=generator(1)).bool())
    for pieces in ([], [torch.zeros(0), torch.ones(3), torch.zeros(0)]):
        initial = torch.tensor([1.0, -0.0, 2.0, -0.0], dtype=torch.float64)
        want, got, zeros = initial.clone(), initial.cuda(), [0] * len(pieces)
        TORCH.sketch_and_squares(pieces, zeros, zeros, signs, 61, want)
        cuda_op.sketch_and_squares([p.cuda() for p in pieces], zeros, zeros, signs.cuda(), 61, got)
        assert same_bits(got, want)


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_steps_sketch_has_the_cpus_bits(cuda_op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_lioncub.step import sketch

    grads = [signed_values(n, seed=n).nan_to_num(0.0, 0.0, 0.0) for n in (4093 * 50 + 1, 64, 1, 5000)]
    tensors = [[g] for g in grads]
    want = sketch.sketch_and_square_norm(tensors, 4093, step=3, shard=0)
    for path in ("compiled", "torch"):  # the kernel, and the scan where the compiled path is not taken
        packing.set_packing_path(path)
        got = sketch.sketch_and_square_norm([[g.cuda()] for g in grads], 4093, step=3, shard=0)
        assert same_bits(got, want), path
        assert same_bits(sketch.gradient_sketch([[g.cuda()] for g in grads], 4093, 3, 0), want[:4093])
    packing.set_packing_path(None)
    monkeypatch.setenv(compiled.KERNELS_ENV, "v1")  # the order before v2: the passes
    passes = sketch.sketch_in_passes([[g.cuda()] for g in grads], 4093, 3, 0)
    assert torch.equal(sketch.gradient_sketch([[g.cuda()] for g in grads], 4093, 3, 0), passes)


@pytest.mark.gpu
@needs_cuda
def test_cuda_op_passes_its_self_check_in_both_generations(cuda_op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_lioncub.kernels.self_check import TRAINING_DTYPES, SelfCheckedPacking

    for generation in ("v1", "v2"):
        monkeypatch.setenv(compiled.KERNELS_ENV, generation)
        ops = SelfCheckedPacking(CompiledPacking(cuda_op, TORCH), f"CUDA op ({generation})", "cuda", object())
        for dtype in TRAINING_DTYPES:
            record = ops.check(dtype)
            assert record.failure is None, record.failure


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantizer", ("sign", "l1"))
@pytest.mark.parametrize("algorithm", ("allreduce", "alltoall"))
def test_cuda_kbit_votes_are_the_same_in_both_generations(
    cuda_op: Any, monkeypatch: pytest.MonkeyPatch, quantizer: str, algorithm: str
) -> None:
    from ds_lioncub.aggregation import Bucket, build_aggregation
    from ds_lioncub.config import parse_config
    from ds_lioncub.planner.calibrate import LoopbackTransport

    values = signed_values(1 << 16, seed=11).nan_to_num(0.0, 0.0, 0.0).cuda()
    results = {}
    for generation in ("v1", "v2"):
        monkeypatch.setenv(compiled.KERNELS_ENV, generation)
        packing._chosen.clear()
        options = parse_config({"compression": "kbit", "bits": 4, "quantizer": quantizer, "kbit_algorithm": algorithm})
        aggregator = build_aggregation(options, LoopbackTransport(3, 0), False)
        bucket = Bucket(values, [1000, 30_000, (1 << 16) - 31_000], [None, None, None])
        message = aggregator.pack(bucket, True)
        out = torch.empty_like(values)
        aggregator.finish(aggregator.start(bucket, False), out=out)
        results[generation] = (message.cpu(), out.cpu())
    packing._chosen.clear()
    assert torch.equal(results["v1"][0], results["v2"][0]) and torch.equal(results["v1"][1], results["v2"][1])
