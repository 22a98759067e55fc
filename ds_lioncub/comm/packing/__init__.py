"""Bit packing for the compressed collectives: the single entry point.

Every compressed message is a flat uint8 tensor in one of two layouts, least significant bit first
(:mod:`.layout`): sign bits (1 means +1) or ``b``-bit unsigned fields, ``b`` in 1, 2, 4, 8.

Each function checks its arguments here, once, and then calls the implementation chosen for the
tensor's device type (:mod:`.dispatch`): the op-builder kernels of ``ops/csrc`` (:mod:`ds_lioncub.kernels.compiled`,
built by :mod:`ds_lioncub.kernels.builders`), cupy for the 1-bit layouts of CUDA tensors (:mod:`.cupy_impl`), or pure
torch (:mod:`.torch_impl`). All three give the same bytes, and the first two are held to it: each
dtype they are asked to handle is first checked against torch (:mod:`ds_lioncub.kernels.self_check`), and a mismatch
raises instead of computing. Two operations fuse a Lion step's local work with the packing
(:func:`lion_direction_pack_signs`, :func:`apply_packed_signs`): the compiled kernels do each in one
pass over memory, the other implementations run the composition of :mod:`ds_lioncub.lion`'s
equations and the packing, which the kernels equal bit for bit. One more is option clip's sketch
(:func:`sketch_and_squares`), whose kernel reads a gradient once with a bit-packed table of signs. Two fuse the
k-bit votes' steps: :func:`vote_field_sums` (unpack or sum the fields, compare, pack) and
:func:`pack_l1_fields_of_means` (the L1 scales from the segments' means, quantize, pack).
``DS_LIONCUB_PACKING`` or :func:`set_packing_path` forces one; ``python -m ds_lioncub.report`` shows
which one runs and why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_lioncub.comm.packing.dispatch import (
    PACKING_ENV,
    PACKING_MODES,
    PackingPath,
    _chosen,  # noqa: F401 - the cache of choices, reachable as packing._chosen (tests clear it)
    ops_for,
    packing_path,
    requested_mode,
    set_packing_path,
)
from ds_lioncub.comm.packing.layout import (
    FIELD_WIDTHS,
    L1_FIELD_WIDTHS,
    MomentumPiece,
    PackingOps,
    ParamPiece,
    packed_length,
)
from ds_lioncub.comm.packing.torch_impl import sign_bits


def _check_width(bits: int) -> None:
    if bits not in FIELD_WIDTHS:
        raise ValueError(f"field width must be one of {FIELD_WIDTHS}, got {bits}")


def _message_bytes(numel: int, bits: int, nbytes: int | None) -> int:
    """The length of a message of ``numel`` ``bits``-wide fields: ``nbytes``, or just enough when None."""
    needed = packed_length(numel, bits)
    if nbytes is not None and nbytes < needed:
        raise ValueError(f"nbytes={nbytes} is smaller than the {needed} bytes the message needs")
    return needed if nbytes is None else nbytes


def _check_stack(packed_rows: torch.Tensor) -> None:
    if packed_rows.dim() != 2:
        raise ValueError(f"packed_rows must be a (p, nbytes) stack, got shape {tuple(packed_rows.shape)}")


# ====================================================================== fields


def pack_fields(values: torch.Tensor, bits: int, *, nbytes: int | None = None) -> torch.Tensor:
    """Pack unsigned ``bits``-wide fields (entries must be < 2**bits) into uint8.

    ``nbytes`` pads the message with zero bytes to that length.
    """
    _check_width(bits)
    flat = values.reshape(-1)
    return ops_for(flat).pack_fields(flat, bits, _message_bytes(flat.numel(), bits, nbytes))


def unpack_fields(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: uint8 tensor of the first ``numel`` fields."""
    _check_width(bits)
    flat = packed.reshape(-1)
    if flat.numel() * 8 < numel * bits:
        raise ValueError(f"{flat.numel()} bytes hold fewer than {numel} {bits}-bit fields")
    return ops_for(flat).unpack_fields(flat, bits, numel)


def sum_fields_per_position(packed_rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """For a ``(p, nbytes)`` stack of packed b-bit messages, the int32 sum of the p fields at each position."""
    _check_width(bits)
    _check_stack(packed_rows)
    if packed_rows.size(1) * 8 < numel * bits:
        raise ValueError(f"rows of {packed_rows.size(1)} bytes hold fewer than {numel} {bits}-bit fields")
    return ops_for(packed_rows).sum_fields_per_position(packed_rows, bits, numel)


# ====================================================================== signs and the 1-bit vote


def pack_signs(
    x: torch.Tensor, zero_is_positive: bool = True, *, bits: int = 1, nbytes: int | None = None
) -> torch.Tensor:
    """Pack the signs of a flat tensor into ``ceil(n/8)`` bytes; zeros follow ``zero_is_positive``.

    ``bits`` > 1 writes each sign as a ``bits``-wide field (1 for +1, 0 for -1), the k-bit "sign"
    quantizer; ``nbytes`` pads the message with zero bytes to that length.
    """
    _check_width(bits)
    flat = x.reshape(-1)
    return ops_for(flat).pack_signs(flat, zero_is_positive, bits, _message_bytes(flat.numel(), bits, nbytes))


def unpack_signs(
    packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Unpack the first ``numel`` sign bits to +1/-1 in ``dtype``.

    ``out``: a contiguous tensor of ``numel`` elements to write into (its dtype wins over ``dtype``);
    it may be the very tensor whose signs were packed, which saves a buffer the size of the output.
    """
    if out is not None:
        if out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous tensor of {numel} elements, got shape {tuple(out.shape)}")
        dtype = out.dtype
    flat = packed.reshape(-1)
    if flat.numel() * 8 < numel:
        raise ValueError(f"{flat.numel()} bytes hold fewer than {numel} signs")
    signs = ops_for(flat).unpack_signs(flat, numel, dtype, None if out is None else out.view(-1))
    return signs if out is None else out


def count_set_bits_per_position(packed_rows: torch.Tensor, numel: int) -> torch.Tensor:
    """For a ``(p, nbytes)`` stack of packed sign messages, the number of +1 votes at each position.

    This is the server half of the 1-bit vote: the returned int32 counts ``k`` give the vote sum
    ``2*k - p``. Temporaries are one unpacked row at a time, so memory stays at the chunk size.
    """
    return sum_fields_per_position(packed_rows, 1, numel)


def vote_packed_signs(packed_rows: torch.Tensor, numel: int, zero_is_positive: bool = True) -> torch.Tensor:
    """The fused server step of the 1-bit vote: majority of a ``(p, nbytes)`` stack of sign messages.

    Returns the packed vote of the first ``numel`` positions (``ceil(numel/8)`` bytes, padding bits
    0): +1 where the vote sum ``2k - p`` is positive, and where it is 0 if ``zero_is_positive``. The
    compiled kernels count with bit-sliced adders and never unpack a bit.
    """
    _check_stack(packed_rows)
    if packed_rows.size(0) < 1:
        raise ValueError("vote_packed_signs needs at least one row")
    if packed_rows.size(1) * 8 < numel:
        raise ValueError(f"rows of {packed_rows.size(1)} bytes hold fewer than {numel} signs")
    return ops_for(packed_rows).vote_packed_signs(packed_rows, numel, zero_is_positive)


def vote_field_sums(packed_rows: torch.Tensor, bits: int, numel: int, threshold: int) -> torch.Tensor:
    """The k-bit votes' reduction in one pass where compiled: packed bits of ``sum >= threshold`` at each position.

    ``sum`` is the int32 sum over the ``(p, nbytes)`` stack of packed ``bits``-wide fields at each of the first
    ``numel`` positions (one row: its own fields, a k-bit all-reduce's summed message). Equal, bit for bit, to
    ``pack_fields(sum_fields_per_position(packed_rows, bits, numel) >= threshold, 1)``; ``packed_length(numel)``
    bytes, padding bits 0. The CUDA kernel never stores a field or a sum.
    """
    _check_width(bits)
    _check_stack(packed_rows)
    if packed_rows.size(0) < 1:
        raise ValueError("vote_field_sums needs at least one row")
    if packed_rows.size(1) * 8 < numel * bits:
        raise ValueError(f"rows of {packed_rows.size(1)} bytes hold fewer than {numel} {bits}-bit fields")
    return ops_for(packed_rows).vote_field_sums(packed_rows, bits, numel, int(threshold))


# ====================================================================== the L1 quantizer


def pack_l1_fields(
    c: torch.Tensor,
    scales: torch.Tensor | Sequence[float],
    segment_sizes: Sequence[int],
    levels: int,
    bits: int,
    *,
    nbytes: int | None = None,
) -> torch.Tensor:
    """The L1 quantizer fused with packing: fields ``q + L`` of ``q = clamp(round(c * s), -L, L)``.

    ``c`` is split into segments of ``segment_sizes``; segment i uses the fp32 scale ``scales[i]``
    (:func:`ds_lioncub.comm.quantize.l1_scale`: ``L / (clip * mu)``, 0 when mu is 0 — then every q
    is 0). Rounding is half to even, as ``torch.round``. Equal to
    ``pack_fields(quantize_l1(...) + L, bits)`` bit for bit.
    """
    if bits not in L1_FIELD_WIDTHS:
        raise ValueError(f"L1 fields are 2, 4 or 8 bits wide, got {bits}")
    flat = c.reshape(-1)
    sizes = [int(size) for size in segment_sizes]
    scales_t = torch.as_tensor(scales, dtype=torch.float32).reshape(-1)
    if len(sizes) != scales_t.numel() or sum(sizes) != flat.numel() or any(size < 0 for size in sizes):
        raise ValueError(
            f"pack_l1_fields: {len(sizes)} segment sizes (total {sum(sizes)}) and {scales_t.numel()} scales "
            f"do not describe {flat.numel()} elements"
        )
    if not (levels >= 1 and 2 * levels <= (1 << bits) - 1):
        raise ValueError(f"pack_l1_fields: {levels} levels do not fit {bits}-bit fields")
    message_bytes = _message_bytes(flat.numel(), bits, nbytes)
    return ops_for(flat).pack_l1_fields(flat, scales_t, sizes, levels, bits, message_bytes)


def pack_l1_fields_of_means(
    c: torch.Tensor,
    means: torch.Tensor | Sequence[float],
    segment_sizes: Sequence[int],
    levels: int,
    clip: float,
    bits: int,
    *,
    nbytes: int | None = None,
) -> torch.Tensor:
    """:func:`pack_l1_fields` with each segment's scale from its mean ``|c|``, in one pass where compiled.

    Segment ``i`` (of ``segment_sizes``) uses the scale :func:`ds_lioncub.comm.quantize.l1_segment_scales` gives for
    ``means[i]``: ``levels / (clip * mu)`` as torch rounds it (0 where mu is not > 0). Equal, bit for bit, to
    ``pack_l1_fields(c, l1_segment_scales(c, levels, clip, segment_sizes, means)[1], segment_sizes, levels, bits)``;
    the CUDA kernel computes the scales itself, so that no scale crosses to the host (no synchronisation).
    """
    if bits not in L1_FIELD_WIDTHS:
        raise ValueError(f"L1 fields are 2, 4 or 8 bits wide, got {bits}")
    flat = c.reshape(-1)
    sizes = [int(size) for size in segment_sizes]
    means_t = means if isinstance(means, torch.Tensor) else torch.as_tensor(means, dtype=torch.float32)
    means_t = means_t.reshape(-1)
    if len(sizes) != means_t.numel() or sum(sizes) != flat.numel() or any(size < 0 for size in sizes):
        raise ValueError(
            f"pack_l1_fields_of_means: {len(sizes)} segment sizes (total {sum(sizes)}) and {means_t.numel()} means "
            f"do not describe {flat.numel()} elements"
        )
    if not (levels >= 1 and 2 * levels <= (1 << bits) - 1):
        raise ValueError(f"pack_l1_fields_of_means: {levels} levels do not fit {bits}-bit fields")
    message_bytes = _message_bytes(flat.numel(), bits, nbytes)
    return ops_for(flat).pack_l1_fields_of_means(flat, means_t, sizes, levels, float(clip), bits, message_bytes)


# ====================================================================== the fused Lion step


def lion_direction_pack_signs(
    pieces: Sequence[MomentumPiece], zero_is_positive: bool = True, *, bits: int = 1, nbytes: int | None = None
) -> torch.Tensor:
    """Lion's direction, the momentum update and :func:`pack_signs`, in one pass where compiled.

    For the pieces of a bucket, in order: ``c = lion_direction(m, g, beta1)`` (fp32), then
    ``update_momentum(m, g, beta2)`` in place, and the returned message is
    ``pack_signs(cat(c), zero_is_positive, bits=bits, nbytes=nbytes)``, bit for bit; ``c`` itself is
    never stored by the compiled kernels. Momentum views must be writable in place (a piece of a
    contiguous tensor); gradients are only read.
    """
    _check_width(bits)
    if not pieces:
        raise ValueError("lion_direction_pack_signs needs at least one piece")
    first = pieces[0].exp_avg
    for piece in pieces:
        if piece.exp_avg.dim() != 1 or piece.grad.numel() != piece.exp_avg.numel():
            raise ValueError("lion_direction_pack_signs: each piece is a flat momentum view and a gradient of its size")
        if piece.exp_avg.device != first.device or piece.grad.device != first.device:
            raise ValueError("lion_direction_pack_signs: every piece must be on one device")
    numel = sum(piece.exp_avg.numel() for piece in pieces)
    flat_pieces = [piece._replace(grad=piece.grad.reshape(-1)) for piece in pieces]
    message_bytes = _message_bytes(numel, bits, nbytes)
    return ops_for(first).lion_direction_pack_signs(flat_pieces, zero_is_positive, bits, message_bytes)


def apply_packed_signs(packed: torch.Tensor, pieces: Sequence[ParamPiece]) -> None:
    """Unpack sign bits and apply Lion's update, in one pass where compiled.

    For the pieces in order, each takes the next ``numel`` bits of ``packed`` (1 = +1) as ``delta``
    and gets ``apply_update(param, delta, lr, weight_decay)``, bit for bit as with ``delta`` unpacked
    to fp32 by :func:`unpack_signs`. Parameter views are updated in place.
    """
    if not pieces:
        raise ValueError("apply_packed_signs needs at least one piece")
    flat = packed.reshape(-1)
    numel = sum(piece.param.numel() for piece in pieces)
    if flat.numel() * 8 < numel:
        raise ValueError(f"{flat.numel()} bytes hold fewer than {numel} signs")
    for piece in pieces:
        if piece.param.dim() != 1 or piece.param.device != flat.device:
            raise ValueError("apply_packed_signs: each piece is a flat parameter view on the device of packed")
    ops_for(flat).apply_packed_signs(flat, pieces)


# ====================================================================== option clip's sketch


def sketch_and_squares(
    pieces: Sequence[torch.Tensor],
    columns: Sequence[int],
    starts: Sequence[int],
    signs: torch.Tensor,
    period: int,
    out: torch.Tensor,
) -> None:
    """Add the sketch of ``pieces`` and the fold of their squares to ``out`` (fp64, ``K + 1`` elements), in place.

    Element ``i`` of ``pieces[p]`` (floating, any shape, read flat) goes to bin ``(columns[p] + i) mod K``
    with the sign bit ``(starts[p] + i) mod period`` of ``signs`` (the sign layout, 1 = +1; ``period + 64`` bits,
    the last 64 a copy of the first 64). Each of ``out``'s first K bins adds its elements' signed fp32 values in
    fp64, one after another in element order, the pieces in the order given; ``out[K]`` adds the pairwise fold
    (:func:`~ds_lioncub.comm.packing.torch_impl.fold_pairwise`) of K bins that sum the elements' squares the same
    way. The compiled kernel reads each fp32, bf16 or fp16 element once (other dtypes take the torch reference);
    every implementation gives the same bits.
    """
    bins = out.numel() - 1
    if out.dim() != 1 or out.dtype != torch.float64 or bins < 1:
        raise ValueError(
            f"sketch_and_squares: out must be a 1-d float64 tensor of bins + 1 >= 2, not {tuple(out.shape)}"
        )
    if signs.dim() != 1 or signs.dtype != torch.uint8 or period < 1 or signs.numel() * 8 < period + 64:
        raise ValueError(f"sketch_and_squares: signs must be uint8 holding period + 64 = {period + 64} bits")
    if not len(pieces) == len(columns) == len(starts):
        raise ValueError("sketch_and_squares: one column and one start per piece")
    # Whole-list checks (the step calls this once with every gradient: a loop of checks per piece would cost more
    # than the kernel on a small model); an implementation refuses pieces on another device than out.
    if pieces and not (0 <= min(columns) and max(columns) < bins and 0 <= min(starts) and max(starts) < period):
        raise ValueError(f"sketch_and_squares: a column outside [0, {bins}) or a start outside [0, {period})")
    if not all(piece.dtype.is_floating_point for piece in pieces):
        raise ValueError("sketch_and_squares: the pieces must be floating point")
    ops_for(out).sketch_and_squares(pieces, columns, starts, signs, period, out)


__all__ = [
    "FIELD_WIDTHS",
    "PACKING_ENV",
    "PACKING_MODES",
    "MomentumPiece",
    "PackingOps",
    "PackingPath",
    "ParamPiece",
    "apply_packed_signs",
    "count_set_bits_per_position",
    "lion_direction_pack_signs",
    "pack_fields",
    "pack_l1_fields",
    "pack_l1_fields_of_means",
    "pack_signs",
    "packed_length",
    "packing_path",
    "requested_mode",
    "set_packing_path",
    "sign_bits",
    "sketch_and_squares",
    "sum_fields_per_position",
    "unpack_fields",
    "unpack_signs",
    "vote_field_sums",
    "vote_packed_signs",
]
