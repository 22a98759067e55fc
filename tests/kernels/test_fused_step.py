"""The fused Lion step operations against plain torch: the ops today's step runs, written out here.

``lion_direction_pack_signs`` must give, bit for bit, the message and momenta of::

    c = torch.empty(n, dtype=float32).copy_(m).mul_(beta1).add_(g, alpha=1 - beta1)
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    message = sign fields of c (1 where c > 0, or c == 0 with positive ties; NaN is -1), LSB first

and ``apply_packed_signs`` the parameters of ``p.mul_(1 - lr * wd)`` (skipped when wd == 0) then
``p.add_(s, alpha=-lr)`` with ``s`` the signs unpacked to ±1 fp32. The references below use only
torch's arithmetic and numpy's bit handling, no library code. Each test runs on every implementation
this process can run (torch always, the compiled CPU op when it builds; the CUDA ones are ``gpu``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ds_lioncub.comm import packing
from ds_lioncub.comm.packing import MomentumPiece, ParamPiece, dispatch
from ds_lioncub.comm.packing.torch_impl import TorchPacking
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.kernels.compiled import CompiledPacking
from ds_lioncub.kernels.self_check import SelfCheckedPacking
from tests.support.implementations import Implementation

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIDTHS = (1, 2, 4, 8)
# Piece layouts of one bucket: single odd lengths, and pieces that start and end mid-byte.
LAYOUTS = ([1], [7], [8], [9], [63], [3, 5, 1, 64, 1000, 7], [100, 33, 4096 * 3 + 5])
BETAS = ((0.9, 0.99), (0.95, 0.98), (0.0, 0.5), (0.5, 0.999), (0.99, 0.9), (0.9, 0.99), (0.8, 0.95))
RATES = ((1e-4, 0.0), (3e-4, 0.1), (1.0, 0.5), (0.1, 1e-9), (2.5e-3, 0.01), (1e-6, 0.0), (0.25, 2.0))
LARGE = 1_000_003  # more than one parallel task of the CPU kernels, odd


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ====================================================================== references


def ref_fields(signs: np.ndarray, bits: int, nbytes: int) -> torch.Tensor:
    """``bits``-wide fields holding ``signs`` (0/1), field i at bits [i*bits, (i+1)*bits), LSB first."""
    out = np.zeros(nbytes, dtype=np.uint8)
    position = np.arange(signs.size, dtype=np.int64) * bits
    np.bitwise_or.at(out, position // 8, (signs.astype(np.uint8) << (position % 8).astype(np.uint8)))
    return torch.from_numpy(out)


def ref_direction(
    momenta: list[torch.Tensor], grads: list[torch.Tensor], zero_is_positive: bool, bits: int, nbytes: int
) -> torch.Tensor:
    """Today's local work of a bucket, op by op: the message; ``momenta`` updated in place."""
    signs = []
    for m, g, (beta1, beta2) in zip(momenta, grads, BETAS, strict=False):
        c = torch.empty(m.numel(), dtype=torch.float32, device=m.device).copy_(m).mul_(beta1).add_(g, alpha=1 - beta1)
        m.mul_(beta2).add_(g, alpha=1 - beta2)
        values = c.cpu().numpy()
        signs.append(values >= 0 if zero_is_positive else values > 0)  # NaN: both False
    return ref_fields(np.concatenate(signs), bits, nbytes)


def ref_apply(packed: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Today's update of a bucket: unpack to ±1 fp32, then mul_ (if wd) and add_ per piece."""
    numel = sum(p.numel() for p in params)
    bits = np.unpackbits(packed.cpu().numpy(), bitorder="little")[:numel].astype(np.float32)
    signs = torch.from_numpy(bits * 2 - 1)
    start = 0
    for p, (lr, weight_decay) in zip(params, RATES, strict=False):
        delta = signs[start : start + p.numel()].to(p.device)
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        p.add_(delta, alpha=-lr)
        start += p.numel()


def nan_as_nan(x: torch.Tensor) -> torch.Tensor:
    """The bits of ``x`` as integers, every NaN made one NaN (payloads are the hardware's choice)."""
    canonical = torch.where(x.isnan(), torch.full_like(x, math.nan), x)
    return canonical.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def same_bits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(nan_as_nan(a), nan_as_nan(b)) for a, b in zip(got, expected, strict=True))


# ====================================================================== inputs


def values(n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    """Random values with exact zeros of both signs and, if ``specials``, NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2
    x[torch.rand(n, generator=g) < 0.2] = 0.0
    x[torch.rand(n, generator=g) < 0.05] = -0.0
    if specials:
        picks = torch.rand(n, generator=g)
        x[picks < 0.01] = math.nan
        x[(picks >= 0.01) & (picks < 0.02)] = math.inf
        x[(picks >= 0.02) & (picks < 0.03)] = -math.inf
    return x.to(dtype)


def run_direction(
    impl: Implementation,
    sizes: list[int],
    dtype: torch.dtype,
    zero_is_positive: bool,
    bits: int,
    pad: int,
    seed: int = 0,
    specials: bool = True,
) -> None:
    n = sum(sizes)
    momenta = values(n, dtype, seed, specials).to(impl.device)
    grads = values(n, dtype, seed + 1, specials).to(impl.device)
    nbytes = packing.packed_length(n, bits) + pad
    expected_m = [m.clone() for m in momenta.split(sizes)]
    expected = ref_direction(expected_m, list(grads.split(sizes)), zero_is_positive, bits, nbytes)
    got_m = momenta.clone()
    pieces = [
        MomentumPiece(m, g, beta1, beta2)
        for m, g, (beta1, beta2) in zip(got_m.split(sizes), grads.split(sizes), BETAS, strict=False)
    ]
    message = packing.lion_direction_pack_signs(pieces, zero_is_positive, bits=bits, nbytes=nbytes)
    assert message.dtype == torch.uint8 and message.device.type == impl.device
    assert torch.equal(message.cpu(), expected), "the packed signs differ"
    assert same_bits(list(got_m.split(sizes)), expected_m), "the updated momenta differ"


# ====================================================================== direction + momentum + pack


@pytest.mark.parametrize("zero_is_positive", [True, False], ids=["positive-ties", "negative-ties"])
@pytest.mark.parametrize("bits", WIDTHS, ids=[f"{b}bit" for b in WIDTHS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda sizes: "+".join(map(str, sizes)))
def test_direction_message_and_momenta_equal_the_torch_ops(
    impl: Implementation, sizes: list[int], dtype: torch.dtype, bits: int, zero_is_positive: bool
) -> None:
    run_direction(impl, sizes, dtype, zero_is_positive, bits, pad=3, seed=sum(sizes) + bits)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_direction_on_a_large_bucket_of_odd_pieces(impl: Implementation, dtype: torch.dtype) -> None:
    run_direction(impl, [3, LARGE - 4, 1], dtype, zero_is_positive=False, bits=1, pad=0, specials=False)
    run_direction(impl, [LARGE], dtype, zero_is_positive=True, bits=1, pad=5, seed=3)


@pytest.mark.parametrize("threads", [1, 2])
def test_direction_is_the_same_on_any_thread_count(impl: Implementation, threads: int) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_direction(impl, [5, 300_001, 2], torch.float32, zero_is_positive=True, bits=4, pad=0, seed=11)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("zero_is_positive", [True, False], ids=["positive-ties", "negative-ties"])
def test_a_zero_direction_takes_the_tie_rule(impl: Implementation, zero_is_positive: bool) -> None:
    # m and g zeros of both signs give c = +0 or -0; both are ties. A negative m with a zero g is -1.
    m = torch.tensor([0.0, -0.0, 0.0, -0.0, -1.0, 1.0, 0.0, -0.0, 0.0], device=impl.device)
    g = torch.tensor([0.0, 0.0, -0.0, -0.0, 0.0, 0.0, 1e-30, -0.0, 0.0], device=impl.device)
    message = packing.lion_direction_pack_signs([MomentumPiece(m, g, 0.9, 0.99)], zero_is_positive)
    tie = 1 if zero_is_positive else 0
    expected = [tie, tie, tie, tie, 0, 1, 1, tie, tie]
    assert ref_fields(np.array(expected), 1, 2).tolist() == message.cpu().tolist()


def test_nan_and_infinities_vote_and_propagate_as_in_torch(impl: Implementation) -> None:
    m = torch.tensor([math.nan, 1.0, math.inf, -math.inf, math.inf, 0.0, -math.nan, 2.0, 3.0], device=impl.device)
    g = torch.tensor([1.0, math.nan, 1.0, 1.0, -math.inf, math.inf, -math.nan, -math.inf, math.nan], device=impl.device)
    expected_m = [m.clone()]
    expected = ref_direction(expected_m, [g], True, 1, 2)
    got_m = m.clone()
    message = packing.lion_direction_pack_signs([MomentumPiece(got_m, g, 0.9, 0.99)], True)
    assert torch.equal(message.cpu(), expected)
    assert same_bits([got_m], expected_m)
    # NaN (c of the first, second, fifth, seventh and last) is -1 even with positive ties
    assert [(message[0].item() >> j) & 1 for j in range(8)] + [message[1].item() & 1] == [0, 0, 1, 0, 0, 1, 0, 0, 0]


def test_mixed_dtypes_in_one_bucket_equal_the_torch_ops(impl: Implementation) -> None:
    # fp32 momentum with a bf16 gradient, fp16 pieces beside fp32 ones: what the kernels do not fuse.
    n = [37, 64, 9]
    momenta = [values(n[0], torch.float32, 1), values(n[1], torch.float16, 2), values(n[2], torch.float32, 3)]
    grads = [values(n[0], torch.bfloat16, 4), values(n[1], torch.float16, 5), values(n[2], torch.float32, 6)]
    momenta = [m.to(impl.device) for m in momenta]
    grads = [g.to(impl.device) for g in grads]
    expected_m = [m.clone() for m in momenta]
    expected = ref_direction(expected_m, grads, False, 1, 20)
    pieces = [MomentumPiece(m, g, b1, b2) for m, g, (b1, b2) in zip(momenta, grads, BETAS, strict=False)]
    message = packing.lion_direction_pack_signs(pieces, False, nbytes=20)
    assert torch.equal(message.cpu(), expected)
    assert same_bits(momenta, expected_m)


# ====================================================================== unpack + apply


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("sizes", [*LAYOUTS, [5, LARGE - 5]], ids=lambda sizes: "+".join(map(str, sizes)))
def test_apply_equals_the_torch_ops(impl: Implementation, sizes: list[int], dtype: torch.dtype) -> None:
    n = sum(sizes)
    params = values(n, dtype, seed=n).to(impl.device)
    g = torch.Generator().manual_seed(n + 1)
    packed = torch.randint(0, 256, (n // 8 + 3,), generator=g, dtype=torch.uint8).to(impl.device)  # noisy tail bits
    expected = [p.clone() for p in params.split(sizes)]
    ref_apply(packed, expected)
    got = params.clone()
    pieces = [ParamPiece(p, lr, wd) for p, (lr, wd) in zip(got.split(sizes), RATES, strict=False)]
    packing.apply_packed_signs(packed, pieces)
    assert same_bits(list(got.split(sizes)), expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lr", [1e-3, 0.5, 3.0])
def test_apply_rounds_the_decay_before_the_step(impl: Implementation, lr: float, weight_decay: float) -> None:
    # Values where a fused p * decay - lr would round differently from torch's two roundings.
    params = (torch.linspace(-3, 3, 4099) * 1.000001).to(impl.device)
    packed = torch.full((513,), 0b10110010, dtype=torch.uint8).to(impl.device)
    expected = [params.clone()]
    signs = torch.from_numpy(np.unpackbits(packed.cpu().numpy(), bitorder="little")[:4099].astype(np.float32) * 2 - 1)
    if weight_decay != 0:
        expected[0].mul_(1 - lr * weight_decay)
    expected[0].add_(signs.to(impl.device), alpha=-lr)
    got = params.clone()
    packing.apply_packed_signs(packed, [ParamPiece(got, lr, weight_decay)])
    assert same_bits([got], expected)


# ====================================================================== which path runs


class Recording:
    """The real op module, recording which functions were called."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.called: list[str] = []

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.real, name)

        def call(*args: Any) -> Any:
            self.called.append(name)
            return function(*args)

        return call


def test_only_pieces_the_kernels_reproduce_reach_them(cpu_op: Any) -> None:
    recording = Recording(cpu_op)
    ops = CompiledPacking(recording, TorchPacking())
    m32, g32 = values(40, torch.float32, 1), values(40, torch.float32, 2)
    ops.lion_direction_pack_signs([MomentumPiece(m32, g32, 0.9, 0.99)], True, 1, 5)
    assert recording.called == ["lion_direction_pack_signs"]
    recording.called.clear()
    # fp32 momentum, bf16 gradient: the torch composition (its sign pack goes through pack_signs)
    ops.lion_direction_pack_signs([MomentumPiece(m32, g32.bfloat16(), 0.9, 0.99)], True, 1, 5)
    assert "lion_direction_pack_signs" not in recording.called
    recording.called.clear()
    # a momentum view the kernel cannot write through
    strided = values(80, torch.float32, 3)[::2]
    ops.lion_direction_pack_signs([MomentumPiece(strided, g32, 0.9, 0.99)], True, 1, 5)
    assert "lion_direction_pack_signs" not in recording.called
    recording.called.clear()
    ops.apply_packed_signs(torch.zeros(5, dtype=torch.uint8), [ParamPiece(values(40, torch.bfloat16, 4), 0.1, 0.1)])
    assert recording.called == ["apply_packed_signs"]
    recording.called.clear()
    ops.apply_packed_signs(torch.zeros(5, dtype=torch.uint8), [ParamPiece(values(80, torch.float32, 5)[::2], 0.1, 0)])
    assert "apply_packed_signs" not in recording.called


class MomentumBitFlipped(Recording):
    """The real op, but the fused direction kernel flips the lowest bit of the first momentum."""

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.real, name)
        if name != "lion_direction_pack_signs":
            return function

        def call(*args: Any) -> Any:
            function(*args)
            args[0][0].view(torch.int32 if args[0][0].dtype == torch.float32 else torch.int16)[0] ^= 1

        return call


class ParamsUntouched(Recording):
    """The real op, but the fused apply does nothing."""

    def __getattr__(self, name: str) -> Any:
        if name == "apply_packed_signs":
            return lambda *args: None
        return getattr(self.real, name)


@pytest.mark.parametrize(
    ("stand_in", "operation"),
    [(MomentumBitFlipped, "lion_direction_pack_signs"), (ParamsUntouched, "apply_packed_signs")],
    ids=["direction", "apply"],
)
def test_a_wrong_fused_kernel_is_refused_on_its_first_use(
    cpu_op: Any, monkeypatch: pytest.MonkeyPatch, stand_in: type[Recording], operation: str
) -> None:
    wrong = stand_in(cpu_op)
    wrong.__name__ = "a wrong stand-in"  # type: ignore[attr-defined]
    monkeypatch.setattr(dispatch, "_load_compiled", lambda device_type: (wrong, "a stand-in around the CPU op"))
    packing._chosen.clear()
    packing.set_packing_path("compiled")
    try:
        ops = packing.packing_path("cpu").ops
        assert isinstance(ops, SelfCheckedPacking)
        m, g = values(16, torch.float32, 1), values(16, torch.float32, 2)
        p = values(16, torch.float32, 3)
        p_before, m_before = p.clone(), m.clone()
        with pytest.raises(LionCubSetupError, match=f"{operation} on float32"):
            if operation == "apply_packed_signs":
                packing.apply_packed_signs(torch.zeros(2, dtype=torch.uint8), [ParamPiece(p, 0.1, 0.0)])
            else:
                packing.lion_direction_pack_signs([MomentumPiece(m, g, 0.9, 0.99)])
        assert torch.equal(p, p_before) and torch.equal(m, m_before), "a refused call changed its inputs"
    finally:
        packing.set_packing_path(None)
        packing._chosen.clear()


def test_bad_arguments_are_refused() -> None:
    m, g = torch.zeros(9), torch.zeros(9)
    with pytest.raises(ValueError, match="at least one piece"):
        packing.lion_direction_pack_signs([])
    with pytest.raises(ValueError, match="gradient of its size"):
        packing.lion_direction_pack_signs([MomentumPiece(m, torch.zeros(8), 0.9, 0.99)])
    with pytest.raises(ValueError, match="smaller than"):
        packing.lion_direction_pack_signs([MomentumPiece(m, g, 0.9, 0.99)], nbytes=1)
    with pytest.raises(ValueError, match="fewer than 9 signs"):
        packing.apply_packed_signs(torch.zeros(1, dtype=torch.uint8), [ParamPiece(m, 0.1, 0.0)])


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_the_report_says_which_fused_step_runs(cpu_op: Any, path: str) -> None:
    from ds_lioncub.report import report

    packing.set_packing_path(path)
    try:
        lines = report(build=True, color=False).splitlines()
    finally:
        packing.set_packing_path(None)
    line = next(line for line in lines if line.startswith("fused step (cpu)"))
    if path == "compiled":
        assert "compiled kernels" in line and "float32/bfloat16/float16" in line
    else:
        assert "torch composition" in line and "torch packing path" in line
