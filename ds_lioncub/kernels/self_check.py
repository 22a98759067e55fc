"""The self-check: a compiled or cupy implementation is compared with the torch reference before it computes.

A kernel that gives other bytes than :mod:`ds_lioncub.comm.packing.torch_impl` (a miscompiled op, a new compiler or CUDA
version, an unusual CPU) would silently change the votes. So the first time such an implementation is
asked to handle a dtype on a device type, :class:`SelfCheckedPacking` runs every operation it provides
for that dtype on a small deterministic random input, with both implementations on that device, and
compares the results exactly:

- floating dtypes and bool: ``pack_signs`` at each field width, both tie rules, with and without
  padding (``nbytes``), sizes 0, 13 and 1029 with zeros of both signs, NaN, infinities and subnormals,
  and a strided view;
- floating dtypes: ``unpack_signs`` into that dtype (a new tensor and ``out``) and ``pack_l1_fields``
  (widths 2/4/8, 1 to the most levels, exact halves for round-half-to-even, a zero scale, an empty
  segment, padding); ``pack_l1_fields_of_means`` the same with the scales from means (a zero mean, a NaN
  mean, a negative one, a subnormal one whose scale overflows to infinity, several clips);
- bool and integer dtypes: ``pack_fields`` at each width, padded and not; signed integers also
  ``unpack_signs`` into them;
- floating dtypes: the fused step operations ``lion_direction_pack_signs`` (momentum and gradient of
  that dtype in pieces of 1 to 1029 elements at unaligned offsets, several betas, each field width, both
  tie rules, padding) and ``apply_packed_signs`` (parameters of that dtype, weight decay zero and not,
  several learning rates); the packed message and the updated tensors are compared, NaN as NaN
  (IEEE 754 leaves which NaN payload an operation on two NaNs returns to the hardware);
- floating dtypes: option clip's ``sketch_and_squares`` (pieces of that dtype, 1 to 1029 elements, in two
  tensors, into 13, 100 and 4,093 bins that start from non-zero sums, tables of signs of 61 and 1,031 bits
  read from near their end, so that pieces and rows cross the period, some rows several times; with and
  without NaN and infinities among the elements), the bins and the squares compared NaN as NaN;
- uint8, the dtype of every message: ``unpack_fields`` at each width, ``sum_fields_per_position`` at each
  width for 1 to 17 rows, and the fused ``vote_packed_signs`` for 1 to 64 voters (every bit-plane count
  of the compiled kernels), both tie rules, even voter counts that meet ties, rows longer than the
  message and non-contiguous rows; ``vote_field_sums`` at each width for 1 to 17 rows, at thresholds
  from below 0 to above the largest sum, rows whose length is and is not a multiple of 16 bytes.

An operation called with a dtype outside this list (``pack_signs`` of int8, say) is checked for that
dtype on its first call too, so no result of an implementation reaches a caller before the same
operation on the same dtype has matched.
The input is made on the CPU with a fixed seed and moved to the device; a case on which the torch
reference itself raises has nothing to compare and is skipped.

A passing check is recorded per (device type, loaded op or cupy module, dtype) for the rest of the
process. A mismatch raises :class:`~ds_lioncub.errors.LionCubSetupError` naming the implementation,
the operation, the dtype and the first differing element, and advising ``DS_LIONCUB_PACKING=torch``;
every later call of that dtype raises it again. Nothing switches to another path on its own: a
kernel that is wrong must be looked at, and forcing the torch path is the user's decision.

The torch implementation is the reference and is never checked. Cost, measured on the CPU op (AVX2,
a 2-core machine that another job kept busy): 65 to 90 ms of CPU time once per process for the six
dtypes training uses (float32, bfloat16, float16, bool, uint8, int32), 48 to 80 ms of wall time
while that job left the cores half free and up to 0.25 s while it ran four processes. Per dtype, at
the lower load: 6 to 18 ms for each float dtype, 17 to 30 ms for uint8 (the torch reference of the
vote with up to 64 voters is most of it), 2 to 5 ms for bool and int32; almost all of it is the torch
side. On top of that, the fused step operations (17 cases per float dtype) take 11 to 15 ms of CPU
time per float dtype (measured alone, load average 3.4 on the same 2 cores); the sketch's 6 cases 5 to 8 ms
per float dtype (load average 2.1, 2026-11-28). After that, each call
pays one set lookup (about 1 µs). ``python -m ds_lioncub.report`` runs the check and prints its time.

This module is the checker; the cases are :mod:`.self_check_cases`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_lioncub.comm.packing.layout import (
    MomentumPiece,
    PackingOps,
    ParamPiece,
)
from ds_lioncub.comm.packing.torch_impl import TorchPacking
from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.kernels.self_check_cases import Case, StepCase, cases_of

OPERATIONS = (
    "pack_fields",
    "unpack_fields",
    "pack_signs",
    "unpack_signs",
    "sum_fields_per_position",
    "vote_packed_signs",
    "vote_field_sums",
    "pack_l1_fields",
    "pack_l1_fields_of_means",
    "lion_direction_pack_signs",
    "apply_packed_signs",
    "sketch_and_squares",
)
FUSED_STEP_OPERATIONS = ("lion_direction_pack_signs", "apply_packed_signs")
MESSAGE_OPERATIONS = ("unpack_fields", "sum_fields_per_position", "vote_packed_signs", "vote_field_sums")

# The dtypes training hands the packing functions (gradients, momenta, fields, messages); the report
# checks these.
TRAINING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.uint8, torch.int32)

_REFERENCE = TorchPacking()


def operations_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The operations whose element dtype can be ``dtype``: what the check of ``dtype`` runs."""
    if dtype.is_complex:
        return ()
    if dtype.is_floating_point:
        return (
            "pack_signs",
            "unpack_signs",
            "pack_l1_fields",
            "pack_l1_fields_of_means",
            *FUSED_STEP_OPERATIONS,
            "sketch_and_squares",
        )
    if dtype == torch.bool:
        return ("pack_signs", "pack_fields")
    operations = ["pack_fields"]
    if dtype.is_signed:
        operations.append("unpack_signs")
    if dtype == torch.uint8:
        operations += MESSAGE_OPERATIONS
    return tuple(operations)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class CheckRecord:
    """The self-check of one implementation on one device type for one dtype."""

    implementation: str
    device_type: str
    dtype: torch.dtype
    operations: set[str] = field(default_factory=set)
    cases: int = 0
    milliseconds: float = 0.0
    failure: str | None = None  # the message of the LionCubSetupError, if an operation did not match


# (device type, op or cupy module, dtype) -> record. The module, not the wrapper: the dispatch cache may
# build several wrappers around one loaded op (one per requested mode), and the check is per process.
_records: dict[tuple[str, Any, torch.dtype], CheckRecord] = {}
_lock = threading.RLock()


class SelfCheckedPacking:
    """:class:`~ds_lioncub.comm.packing.layout.PackingOps` that hands each operation and dtype to ``ops`` only once it
    has matched torch.

    ``implementation`` names it in messages (``"compiled op lioncub_packing_cpu"``, ``"cupy 13.3.0"``);
    ``module`` is the loaded op or cupy module, the identity under which passing checks are recorded.
    """

    def __init__(self, ops: PackingOps, implementation: str, device_type: str, module: Any) -> None:
        self.ops = ops
        self.implementation = implementation
        self.device_type = device_type
        self.module = module
        self._passed: set[tuple[str, torch.dtype]] = set()  # the hot path: one set lookup per call

    # ------------------------------------------------------------------ the check

    def check(
        self, dtype: torch.dtype, operation: str | None = None, device: torch.device | None = None
    ) -> CheckRecord:
        """Run the check of ``dtype`` (and of ``operation`` on it) unless it ran; the record, failed or not.

        The check runs on ``device`` (the device of the tensor that asked), by default the device type's
        current device.
        """
        key = (self.device_type, self.module, dtype)
        with _lock:
            record = _records.get(key)
            if record is None:
                record = _records[key] = CheckRecord(self.implementation, self.device_type, dtype)
            asked = (*operations_for(dtype), *([] if operation is None else [operation]))
            wanted = [name for name in dict.fromkeys(asked) if name not in record.operations]
            if wanted and record.failure is None:
                _run_check(self.ops, record, wanted, device or torch.device(self.device_type))
            record.operations.update(wanted)
        return record

    def _verify(self, operation: str, dtype: torch.dtype, tensor: torch.Tensor) -> None:
        """Raise unless ``operation`` on ``dtype`` matched torch (checking it now, on ``tensor``'s device, if new)."""
        if (operation, dtype) in self._passed:
            return
        record = self.check(dtype, operation, tensor.device)
        if record.failure is not None:
            raise LionCubSetupError(record.failure)
        self._passed.add((operation, dtype))

    # ------------------------------------------------------------------ PackingOps

    def pack_fields(self, flat: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
        self._verify("pack_fields", flat.dtype, flat)
        return self.ops.pack_fields(flat, bits, nbytes)

    def unpack_fields(self, packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        self._verify("unpack_fields", packed.dtype, packed)
        return self.ops.unpack_fields(packed, bits, numel)

    def pack_signs(self, flat: torch.Tensor, zero_is_positive: bool, bits: int, nbytes: int) -> torch.Tensor:
        self._verify("pack_signs", flat.dtype, flat)
        return self.ops.pack_signs(flat, zero_is_positive, bits, nbytes)

    def unpack_signs(
        self, packed: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor:
        self._verify("unpack_signs", dtype if out is None else out.dtype, packed)
        return self.ops.unpack_signs(packed, numel, dtype, out)

    def sum_fields_per_position(self, rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
        self._verify("sum_fields_per_position", rows.dtype, rows)
        return self.ops.sum_fields_per_position(rows, bits, numel)

    def vote_packed_signs(self, rows: torch.Tensor, numel: int, zero_is_positive: bool) -> torch.Tensor:
        self._verify("vote_packed_signs", rows.dtype, rows)
        return self.ops.vote_packed_signs(rows, numel, zero_is_positive)

    def vote_field_sums(self, rows: torch.Tensor, bits: int, numel: int, threshold: int) -> torch.Tensor:
        self._verify("vote_field_sums", rows.dtype, rows)
        return self.ops.vote_field_sums(rows, bits, numel, threshold)

    def pack_l1_fields(
        self, flat: torch.Tensor, scales: torch.Tensor, sizes: list[int], levels: int, bits: int, nbytes: int
    ) -> torch.Tensor:
        self._verify("pack_l1_fields", flat.dtype, flat)
        return self.ops.pack_l1_fields(flat, scales, sizes, levels, bits, nbytes)

    def pack_l1_fields_of_means(
        self,
        flat: torch.Tensor,
        means: torch.Tensor,
        sizes: list[int],
        levels: int,
        clip: float,
        bits: int,
        nbytes: int,
    ) -> torch.Tensor:
        self._verify("pack_l1_fields_of_means", flat.dtype, flat)
        return self.ops.pack_l1_fields_of_means(flat, means, sizes, levels, clip, bits, nbytes)

    def lion_direction_pack_signs(
        self, pieces: Sequence[MomentumPiece], zero_is_positive: bool, bits: int, nbytes: int
    ) -> torch.Tensor:
        for dtype in dict.fromkeys(piece.exp_avg.dtype for piece in pieces):
            self._verify("lion_direction_pack_signs", dtype, pieces[0].exp_avg)
        return self.ops.lion_direction_pack_signs(pieces, zero_is_positive, bits, nbytes)

    def apply_packed_signs(self, packed: torch.Tensor, pieces: Sequence[ParamPiece]) -> None:
        for dtype in dict.fromkeys(piece.param.dtype for piece in pieces):
            self._verify("apply_packed_signs", dtype, packed)
        self.ops.apply_packed_signs(packed, pieces)

    def sketch_and_squares(
        self,
        pieces: Sequence[torch.Tensor],
        columns: Sequence[int],
        starts: Sequence[int],
        signs: torch.Tensor,
        period: int,
        out: torch.Tensor,
    ) -> None:
        for dtype in dict.fromkeys(piece.dtype for piece in pieces):
            self._verify("sketch_and_squares", dtype, out)
        self.ops.sketch_and_squares(pieces, columns, starts, signs, period, out)


def _run_check(ops: PackingOps, record: CheckRecord, operations: list[str], device: torch.device) -> None:
    """Every case of ``operations`` on ``record.dtype``, ``ops`` against torch; the first mismatch fails the record."""
    start = time.perf_counter()
    try:
        for operation in operations:
            for case in cases_of(operation, record.dtype, device):
                try:
                    expected = case.run(_REFERENCE)
                except Exception:  # noqa: BLE001 - torch refuses this input too: nothing to hold ops to
                    continue
                record.cases += 1
                try:
                    got = case.run(ops)
                except Exception as error:  # noqa: BLE001 - reported as a failed check, with the error
                    record.failure = _message(record, case, f"raised {type(error).__name__}: {error}")
                    return
                difference = _difference(got, expected)
                if difference is not None:
                    record.failure = _message(record, case, difference)
                    return
    finally:
        record.milliseconds += (time.perf_counter() - start) * 1000.0


def _difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None if identical (dtype, shape, every element); else where they first differ."""
    if got.dtype != expected.dtype or got.shape != expected.shape or got.device != expected.device:
        return (
            f"gave {got.dtype} of shape {tuple(got.shape)} on {got.device} instead of {expected.dtype} "
            f"of shape {tuple(expected.shape)} on {expected.device}"
        )
    if torch.equal(got, expected):
        return None
    got_flat, expected_flat = got.reshape(-1).cpu(), expected.reshape(-1).cpu()
    index = int((got_flat != expected_flat).nonzero()[0, 0])
    return f"element {index} is {got_flat[index].item()} instead of {expected_flat[index].item()}"


def _message(record: CheckRecord, case: Case | StepCase, difference: str) -> str:
    return (
        f"the {record.implementation} packing implementation does not match the torch reference on "
        f"{record.device_type} tensors: {case.operation} on {dtype_name(record.dtype)} ({case.description}) "
        f"{difference}. LionCub will not use results it cannot trust; set DS_LIONCUB_PACKING=torch to run "
        "the pure torch path (the same bytes, slower), and report this with the output of "
        "`python -m ds_lioncub.report`."
    )


__all__ = ["OPERATIONS", "TRAINING_DTYPES", "CheckRecord", "SelfCheckedPacking", "dtype_name", "operations_for"]
