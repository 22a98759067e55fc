"""The self-check of the compiled kernels against the torch reference (ds_lioncub/kernels/self_check.py).

The real CPU op must pass it. A wrong kernel cannot be built on purpose, so the refusal is tested with a
stand-in: the real op module wrapped so that one function flips one bit of its output for one dtype
(and, for some, only for one field width, one tie rule or in the padding). Such an op must be refused on
the first call of that operation and dtype, with a message naming it, before the caller's tensors
reach it. The torch path is the reference and is never checked; the check runs once per (device, dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub.comm.packing import dispatch
from ds_lioncub.comm.packing.torch_impl import TorchPacking
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.kernels import self_check
from ds_lioncub.kernels.compiled import CompiledPacking
from ds_lioncub.kernels.self_check import TRAINING_DTYPES, SelfCheckedPacking, operations_for


@pytest.fixture(autouse=True)
def _fresh_choices() -> Iterator[None]:
    """Each test chooses its path afresh, and leaves no stand-in in the dispatch cache."""
    packing._chosen.clear()
    yield
    packing._chosen.clear()


class CountingOp:
    """The real op module, counting the calls of each function and keeping their arguments."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.__name__ = f"stand-in around {real.__name__}"
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.real, name)

        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            result = function(*args)
            self.after(name, args)
            return result

        return call

    def after(self, name: str, args: tuple[Any, ...]) -> None:
        """What the stand-in does to the output (``args[-1]``) after the real function wrote it."""

    def received(self, tensor: torch.Tensor) -> bool:
        """Whether a call got ``tensor``'s memory (the public functions pass views of it, not the object)."""
        return any(
            isinstance(arg, torch.Tensor) and arg.data_ptr() == tensor.data_ptr()
            for _, args in self.calls
            for arg in args
        )


class OneBitFlipped(CountingOp):
    """Flips bit 0 of the first (or last) byte of ``function``'s output where ``when(args)`` holds."""

    def __init__(self, real: Any, function: str, when: Callable[[tuple[Any, ...]], bool], last: bool) -> None:
        super().__init__(real)
        self.function, self.when, self.last = function, when, last
        self.flips = 0

    def after(self, name: str, args: tuple[Any, ...]) -> None:
        out = args[-1]
        if name == self.function and out.numel() > 0 and self.when(args):
            out.view(torch.uint8).view(-1)[-1 if self.last else 0] ^= 1
            self.flips += 1


def use_compiled(op: Any) -> SelfCheckedPacking:
    """Force the compiled path with ``op`` as its loaded module; the implementation handed out."""
    packing.set_packing_path("compiled")
    packing._chosen.clear()
    choice = packing.packing_path("cpu")
    assert choice.path == "compiled" and choice.module is op
    assert isinstance(choice.ops, SelfCheckedPacking)
    return choice.ops


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], SelfCheckedPacking]:
    def install(op: Any) -> SelfCheckedPacking:
        monkeypatch.setattr(dispatch, "_load_compiled", lambda device_type: (op, "a stand-in around the CPU op"))
        return use_compiled(op)

    return install


def packed_rows(p: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (p, (numel + 7) // 8), generator=g, dtype=torch.int64).to(torch.uint8)


def values(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


# ====================================================================== the real op


def test_the_real_compiled_op_passes_for_every_dtype_training_uses(cpu_op) -> None:
    ops = use_compiled(cpu_op)
    for dtype in TRAINING_DTYPES:
        record = ops.check(dtype)
        assert record.failure is None, record.failure
        assert record.operations >= set(operations_for(dtype)) and record.cases > 0  # earlier tests may add some
        assert record.implementation == "compiled op lioncub_packing_cpu" and record.device_type == "cpu"
    # every operation is checked for some dtype
    assert set().union(*(operations_for(dtype) for dtype in TRAINING_DTYPES)) == set(self_check.OPERATIONS)
    # and the checked op computes: p = 4 rows 0b1111_0000 (x2) and 0b1100_1100 (x2) have 2 (a tie), 4 or 0 plus
    # votes at each position
    rows = torch.tensor([[0xF0], [0xF0], [0xCC], [0xCC]], dtype=torch.uint8)
    assert packing.vote_packed_signs(rows, 8, True).tolist() == [0b1111_1100]
    assert packing.vote_packed_signs(rows, 8, False).tolist() == [0b1100_0000]


def test_the_report_shows_the_self_check_passed(cpu_op) -> None:
    from ds_lioncub.report import report

    lines = report(build=True, color=False).splitlines()
    line = next(line for line in lines if line.startswith("self-check (cpu)"))
    assert "PASSED" in line and "float32, bfloat16, float16, bool, uint8, int32" in line and " ms " in line


# ====================================================================== a wrong kernel


class Wrong(NamedTuple):
    """One bit flipped in ``function``'s output for ``dtype`` where ``when`` holds; ``call`` triggers it."""

    function: str  # the op module's function
    operation: str  # the packing operation, as the message names it
    dtype: torch.dtype
    when: Callable[[tuple[Any, ...]], bool]
    last: bool  # flip the last byte (the padding) instead of the first
    call: Callable[[], torch.Tensor]  # a public call that reaches the function with that dtype and condition


def _padded(args: tuple[Any, ...]) -> bool:
    x, _, bits, out = args
    return out.numel() > packing.packed_length(x.numel(), bits)


WRONG = {
    "vote-ties-to-plus": Wrong(
        "vote_packed_signs",
        "vote_packed_signs",
        torch.uint8,
        lambda args: args[2] is True,
        False,
        lambda: packing.vote_packed_signs(packed_rows(4, 100, seed=1), 100, True),
    ),
    "vote-ties-to-minus-64-voters": Wrong(
        "vote_packed_signs",
        "vote_packed_signs",
        torch.uint8,
        lambda args: args[2] is False and args[0].size(0) == 64,
        False,
        lambda: packing.vote_packed_signs(packed_rows(64, 1029, seed=2), 1029, False),
    ),
    "pack-signs-bf16-4bit": Wrong(
        "pack_signs",
        "pack_signs",
        torch.bfloat16,
        lambda args: args[0].dtype == torch.bfloat16 and args[2] == 4,
        False,
        lambda: packing.pack_signs(values(33, seed=3, dtype=torch.bfloat16), bits=4),
    ),
    "pack-signs-fp16-padding": Wrong(
        "pack_signs",
        "pack_signs",
        torch.float16,
        lambda args: args[0].dtype == torch.float16 and _padded(args),
        True,
        lambda: packing.pack_signs(values(33, seed=4, dtype=torch.float16), nbytes=9),
    ),
    "pack-signs-fp32-zeros-negative-2bit": Wrong(
        "pack_signs",
        "pack_signs",
        torch.float32,
        lambda args: args[0].dtype == torch.float32 and args[1] is False and args[2] == 2,
        False,
        lambda: packing.pack_signs(torch.zeros(5), zero_is_positive=False, bits=2),
    ),
    "unpack-signs-bf16": Wrong(
        "unpack_signs",
        "unpack_signs",
        torch.bfloat16,
        lambda args: args[1].dtype == torch.bfloat16,
        False,
        lambda: packing.unpack_signs(packed_rows(1, 20, seed=5)[0], 20, torch.bfloat16),
    ),
    "l1-fp32-8bit": Wrong(
        "quantize_l1_pack",
        "pack_l1_fields",
        torch.float32,
        lambda args: args[0].dtype == torch.float32 and args[4] == 8,
        False,
        lambda: packing.pack_l1_fields(values(40, seed=6, dtype=torch.float32), [2.0], [40], 100, 8),
    ),
    "sum-fields-2bit": Wrong(
        "sum_fields",
        "sum_fields_per_position",
        torch.uint8,
        lambda args: args[1] == 2,
        False,
        lambda: packing.sum_fields_per_position(packed_rows(3, 80, seed=7), 2, 40),
    ),
    "pack-fields-int32-1bit": Wrong(
        "pack_fields",
        "pack_fields",
        torch.int32,
        lambda args: args[0].dtype == torch.int32 and args[1] == 1,
        False,
        lambda: packing.pack_fields(torch.ones(9, dtype=torch.int32), 1),
    ),
    "pack-fields-bool": Wrong(
        "pack_fields",
        "pack_fields",
        torch.bool,
        lambda args: args[0].dtype == torch.bool,
        False,
        lambda: packing.pack_fields(torch.ones(9, dtype=torch.bool), 1),
    ),
    "unpack-fields-8bit": Wrong(
        "unpack_fields",
        "unpack_fields",
        torch.uint8,
        lambda args: args[1] == 8,
        False,
        lambda: packing.unpack_fields(packed_rows(1, 80, seed=8)[0], 8, 10),
    ),
}


@pytest.mark.parametrize("case", list(WRONG.values()), ids=list(WRONG))
def test_a_kernel_that_flips_one_bit_is_refused_on_its_first_use(cpu_op, stand_in, case: Wrong) -> None:
    wrong = OneBitFlipped(cpu_op, case.function, case.when, case.last)
    # The stand-in is wrong on exactly this call: without the check, its result differs from torch's.
    packing.set_packing_path("torch")
    reference = case.call()
    unchecked = CompiledPacking(wrong, TorchPacking())
    packing.set_packing_path("compiled")
    packing._chosen.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "_load_compiled", lambda device_type: (wrong, "unchecked"))
        patch.setattr(dispatch, "SelfCheckedPacking", lambda ops, *rest: unchecked)
        assert not torch.equal(case.call(), reference)
    packing._chosen.clear()
    assert wrong.flips == 1
    wrong.calls.clear()

    stand_in(wrong)
    with pytest.raises(LionCubSetupError) as raised:
        case.call()
    message = str(raised.value)
    assert message.startswith("LionCub: the compiled op stand-in around lioncub_packing_cpu packing implementation")
    assert f"{case.operation} on {str(case.dtype).removeprefix('torch.')} (" in message
    assert "DS_LIONCUB_PACKING=torch" in message
    assert wrong.flips >= 1  # the check met the wrong case itself
    # The caller's call did not reach the kernel: every call so far was the check's own.
    checked_calls = len(wrong.calls)
    with pytest.raises(LionCubSetupError, match="DS_LIONCUB_PACKING=torch"):
        case.call()  # refused again, no silent switch to another path
    assert len(wrong.calls) == checked_calls
    assert packing.packing_path("cpu").path == "compiled"


def test_a_refused_call_leaves_out_untouched(cpu_op, stand_in) -> None:
    wrong = OneBitFlipped(cpu_op, "unpack_signs", lambda args: args[1].dtype == torch.float16, False)
    stand_in(wrong)
    out = torch.full((20,), 5.0, dtype=torch.float16)
    packed = packed_rows(1, 20, seed=9)[0]
    with pytest.raises(LionCubSetupError, match="unpack_signs on float16"):
        packing.unpack_signs(packed, 20, out=out)
    assert out.eq(5.0).all() and not wrong.received(out) and not wrong.received(packed)


def test_a_wrong_dtype_does_not_stop_the_others(cpu_op, stand_in) -> None:
    wrong = OneBitFlipped(cpu_op, "pack_signs", lambda args: args[0].dtype == torch.bfloat16, False)
    stand_in(wrong)
    x = values(100, seed=10, dtype=torch.float32)
    expected = TorchPacking().pack_signs(x, True, 1, 13)
    assert torch.equal(packing.pack_signs(x), expected)
    assert wrong.received(x)  # float32 passed its check and is served by the kernel
    with pytest.raises(LionCubSetupError, match="pack_signs on bfloat16"):
        packing.pack_signs(x.bfloat16())


def test_the_report_shows_what_failed(cpu_op, stand_in) -> None:
    from ds_lioncub.report import report

    stand_in(OneBitFlipped(cpu_op, "vote_packed_signs", lambda args: True, False))
    lines = report(build=True, color=False).splitlines()
    line = next(line for line in lines if line.startswith("self-check (cpu)"))
    assert "FAILED" in line and "uint8" in line and "vote_packed_signs" in line
    assert "DS_LIONCUB_PACKING=torch" in line


# ====================================================================== when the check runs


@pytest.fixture
def check_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, tuple[str, ...]]]:
    """Every run of the check: (dtype, the operations it covered)."""
    runs: list[tuple[torch.dtype, tuple[str, ...]]] = []
    real = self_check._run_check

    def counting(ops: Any, record: Any, operations: list[str], device: torch.device) -> None:
        runs.append((record.dtype, tuple(operations)))
        real(ops, record, operations, device)

    monkeypatch.setattr(self_check, "_run_check", counting)
    return runs


def test_the_torch_path_is_never_checked(check_runs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packing.PACKING_ENV, "torch")
    choice = packing.packing_path("cpu")
    assert choice.path == "torch" and not isinstance(choice.ops, SelfCheckedPacking)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = values(50, seed=11, dtype=dtype)
        signs = packing.unpack_signs(packing.pack_signs(x), 50, dtype)
        assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0).to(dtype))
        packing.pack_l1_fields(x, [1.0], [50], 1, 2)
    rows = packed_rows(3, 50, seed=12)
    packing.vote_packed_signs(rows, 50)
    packing.sum_fields_per_position(rows, 2, 25)
    packing.unpack_fields(packing.pack_fields(torch.ones(9, dtype=torch.int32), 2), 2, 9)
    assert check_runs == []


def test_the_check_runs_once_per_device_and_dtype(cpu_op, stand_in, check_runs) -> None:
    counting = CountingOp(cpu_op)
    stand_in(counting)
    x = values(100, seed=13, dtype=torch.float32)

    packing.pack_signs(x)
    assert check_runs == [(torch.float32, operations_for(torch.float32))]
    assert [name for name, _ in counting.calls].count("quantize_l1_pack") > 0  # the whole float32 plan ran
    calls = len(counting.calls)
    packing.pack_signs(x)
    packing.unpack_signs(packing.pack_signs(x), 100, torch.float32)  # also in float32's check
    packing.pack_l1_fields(x, [1.0], [100], 1, 2)
    assert len(counting.calls) == calls + 4  # the callers' own calls, nothing more
    assert len(check_runs) == 1

    packing.pack_signs(x.bfloat16())  # a new dtype: its own check
    packing.pack_signs(x.bfloat16())
    assert check_runs[1:] == [(torch.bfloat16, operations_for(torch.bfloat16))]

    rows = packed_rows(5, 100, seed=14)
    packing.vote_packed_signs(rows, 100)
    packing.sum_fields_per_position(rows, 1, 100)
    packing.unpack_fields(rows[0], 1, 100)
    assert check_runs[2:] == [(torch.uint8, operations_for(torch.uint8))]

    # another mode's choice wraps the same loaded op: checked already in this process
    packing.set_packing_path("auto")
    packing._chosen.clear()
    assert packing.packing_path("cpu").module is counting
    packing.pack_signs(x)
    packing.vote_packed_signs(rows, 100)
    assert len(check_runs) == 3


def test_an_operation_outside_its_dtypes_plan_is_checked_on_its_first_call(cpu_op, stand_in, check_runs) -> None:
    stand_in(CountingOp(cpu_op))
    assert "pack_signs" not in operations_for(torch.int8)
    x = torch.tensor([-2, 0, 3, -1, 1], dtype=torch.int8)
    assert packing.pack_signs(x).tolist() == [0b1_0110]
    assert check_runs == [(torch.int8, (*operations_for(torch.int8), "pack_signs"))]
    assert packing.unpack_signs(packing.pack_signs(x), 5, torch.int8).tolist() == [-1, 1, 1, -1, 1]
    packing.pack_fields(x.abs(), 2)
    assert len(check_runs) == 1  # unpack_signs and pack_fields were in int8's check
    packing.vote_packed_signs(torch.tensor([[3], [5]], dtype=torch.int8), 3)
    assert check_runs[1:] == [(torch.int8, ("vote_packed_signs",))]


def test_the_check_leaves_the_global_random_state_alone(cpu_op, stand_in) -> None:
    ops = stand_in(CountingOp(cpu_op))  # a module not checked yet in this process
    state = torch.get_rng_state()
    assert all(ops.check(dtype).failure is None for dtype in TRAINING_DTYPES)
    assert torch.equal(torch.get_rng_state(), state)
