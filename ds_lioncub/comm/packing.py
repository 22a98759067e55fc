"""Bit packing for the compressed collectives.

Every compressed message is a flat uint8 tensor. Two layouts are used, both least significant
bit first so that element order equals bit order:

- signs: element ``8*i + j`` is bit ``j`` of byte ``i`` (1 means +1, 0 means -1);
- fields: ``b``-bit unsigned fields, element ``(8//b)*i + j`` in bits ``[j*b, (j+1)*b)`` of byte ``i``.

This module is the single entry point for packing. Each function runs on one of three paths, all
bit-exact with each other:

- ``compiled``: the op-builder kernels in ``ops/csrc`` (``ds_lioncub.op_builder``): C++/OpenMP/AVX2
  on CPU tensors, CUDA on GPU tensors; prebuilt at install time or JIT-built once on first use;
- ``cupy``: ``cupy.packbits``/``unpackbits`` for the 1-bit layouts of CUDA tensors (what the Lion Cub
  authors used), the rest in torch;
- ``torch``: vectorised pure torch (the reference the kernels are tested against).

``auto`` (the default) takes the first that works for the tensor's device, in that order; a compiled
op that fails to build or load is logged as a warning and the next path is used. The environment
variable ``DS_LIONCUB_PACKING=auto|compiled|cupy|torch`` (or :func:`set_packing_path`) overrides
it; forcing ``compiled`` where it cannot run, or ``cupy`` for CUDA tensors without cupy, raises
instead of falling back (``cupy`` leaves CPU tensors to torch). The choice and its reason are
logged once per device type and shown by ``python -m ds_lioncub.report``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

FIELD_WIDTHS = (1, 2, 4, 8)
PACKING_ENV = "DS_LIONCUB_PACKING"
PACKING_MODES = ("auto", "compiled", "cupy", "torch")


def packed_length(numel: int, bits: int = 1) -> int:
    """Bytes needed for ``numel`` fields of ``bits`` bits."""
    return (numel * bits + 7) // 8


def _check_width(bits: int) -> None:
    if bits not in FIELD_WIDTHS:
        raise ValueError(f"field width must be one of {FIELD_WIDTHS}, got {bits}")


# ====================================================================== path selection


class PackingPath(NamedTuple):
    """The path packing takes for one device type, and why."""

    path: str  # "compiled", "cupy" or "torch"
    reason: str
    module: Any = None  # the compiled op module or the cupy module
    degraded: bool = False  # the compiled op should have loaded here but failed (logged as a warning)


_override: str | None = None
_chosen: dict[tuple[str, str], PackingPath] = {}


def set_packing_path(mode: str | None) -> None:
    """Override ``DS_LIONCUB_PACKING`` for this process (``None`` goes back to the variable)."""
    global _override
    if mode is not None:
        _validate_mode(mode, "set_packing_path")
    _override = mode


def _validate_mode(mode: str, origin: str) -> str:
    if mode not in PACKING_MODES:
        raise ValueError(f"{origin}={mode!r}: the packing path must be one of {list(PACKING_MODES)}")
    return mode


def requested_mode() -> str:
    """The requested mode: :func:`set_packing_path`, else ``DS_LIONCUB_PACKING``, else "auto"."""
    if _override is not None:
        return _override
    value = os.environ.get(PACKING_ENV, "").strip().lower() or "auto"
    return _validate_mode(value, PACKING_ENV)


def packing_path(device: torch.device | str = "cpu") -> PackingPath:
    """The path used for tensors on ``device`` (loading, or JIT-building once, the compiled op)."""
    device_type = torch.device(device).type
    mode = requested_mode()
    key = (device_type, mode)
    choice = _chosen.get(key)
    if choice is None:
        choice = _choose(device_type, mode)
        _chosen[key] = choice
        from ds_lioncub.op_builder import get_logger

        log = get_logger().warning if choice.degraded else get_logger().info
        log(f"packing on {device_type} tensors: {choice.path} path ({choice.reason})")
    return choice


def _origin(mode: str) -> str:
    return "set_packing_path" if _override is not None else PACKING_ENV


def _choose(device_type: str, mode: str) -> PackingPath:
    if mode == "torch":
        return PackingPath("torch", f"{_origin(mode)}=torch")
    notes = []
    degraded = False
    if mode in ("auto", "compiled"):
        compiled, why = _load_compiled(device_type)
        degraded = compiled is None and why.startswith("loading the op failed")
        if compiled is not None:
            forced = f"{_origin(mode)}=compiled; " if mode == "compiled" else ""
            return PackingPath("compiled", forced + why, compiled)
        if mode == "compiled":
            raise RuntimeError(f"ds_lioncub: {_origin(mode)}=compiled, but the compiled packing op is unavailable: {why}")
        notes.append(f"compiled op unavailable: {why}")
    if mode in ("auto", "cupy"):
        cupy, why = _load_cupy(device_type)
        if cupy is not None:
            forced = f"{_origin(mode)}=cupy; " if mode == "cupy" else ""
            return PackingPath("cupy", forced + why, cupy, degraded)
        if mode == "cupy" and device_type == "cuda":
            raise RuntimeError(f"ds_lioncub: {_origin(mode)}=cupy, but cupy is unavailable: {why}")
        notes.append(f"cupy: {why}")
    return PackingPath("torch", "; ".join(notes) + "; the pure torch path gives the same bits", None, degraded)


def _load_compiled(device_type: str) -> tuple[Any, str]:
    """(module, how it was loaded) or (None, why not)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return None, "no CUDA device"
    if device_type not in ("cpu", "cuda"):
        return None, f"no kernels for {device_type} tensors"
    try:
        from ds_lioncub.op_builder import builders

        builder = builders()[device_type]
        if not builder.is_compatible():
            return None, f"op {builder.name} is not compatible here: {builder.error_log}"
        module = builder.load()
    except Exception as error:  # a failed build must not stop training: the torch path is exact
        lines = str(error).strip().splitlines() or [""]
        return None, f"loading the op failed: {type(error).__name__}: {lines[0][:300]}"
    extra = f", {module.simd()}, {torch.get_num_threads()} threads" if device_type == "cpu" else ""
    return module, f"op {builder.name} from {builder.load_source}{extra}"


def _load_cupy(device_type: str) -> tuple[Any, str]:
    if device_type != "cuda":
        return None, "cupy handles CUDA tensors only"
    try:
        import cupy
    except Exception as error:
        return None, f"not importable ({type(error).__name__}: {error})"
    return cupy, f"cupy {cupy.__version__} packbits/unpackbits for the 1-bit layouts, torch for the rest"


def _path(tensor: torch.Tensor) -> PackingPath:
    return packing_path(tensor.device)


def _new_bytes(nbytes: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _pad_bytes(packed: torch.Tensor, nbytes: int | None) -> torch.Tensor:
    if nbytes is None or nbytes == packed.numel():
        return packed
    if nbytes < packed.numel():
        raise ValueError(f"nbytes={nbytes} is smaller than the {packed.numel()} bytes the message needs")
    return torch.cat([packed, packed.new_zeros(nbytes - packed.numel())])


def _out_bytes(numel: int, bits: int, nbytes: int | None) -> int:
    needed = packed_length(numel, bits)
    if nbytes is not None and nbytes < needed:
        raise ValueError(f"nbytes={nbytes} is smaller than the {needed} bytes the message needs")
    return needed if nbytes is None else nbytes


_SIGN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool)
_UNPACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FIELD_DTYPES = (torch.uint8, torch.bool, torch.int32)


# ====================================================================== public API


def pack_fields(values: torch.Tensor, bits: int, *, nbytes: int | None = None) -> torch.Tensor:
    """Pack unsigned ``bits``-wide fields (entries must be < 2**bits) into uint8.

    ``nbytes`` pads the message with zero bytes to that length.
    """
    _check_width(bits)
    flat = values.reshape(-1)
    choice = _path(flat)
    if choice.path == "compiled" and flat.dtype in _FIELD_DTYPES:
        flat = flat.contiguous()
        out = _new_bytes(_out_bytes(flat.numel(), bits, nbytes), flat)
        choice.module.pack_fields(flat, bits, out)
        return out
    if choice.path == "cupy" and bits == 1:
        return _pad_bytes(_cupy_pack_bits(choice.module, flat), nbytes)
    return _pad_bytes(_torch_pack_fields(flat, bits), nbytes)


def unpack_fields(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: uint8 tensor of the first ``numel`` fields."""
    _check_width(bits)
    choice = _path(packed)
    if choice.path == "compiled" and packed.dtype == torch.uint8:
        flat = packed.reshape(-1).contiguous()
        if flat.numel() * 8 < numel * bits:
            raise ValueError(f"{flat.numel()} bytes hold fewer than {numel} {bits}-bit fields")
        out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
        choice.module.unpack_fields(flat, bits, out)
        return out
    if choice.path == "cupy" and bits == 1:
        return _cupy_unpack_bits(choice.module, packed, numel)
    return _torch_unpack_fields(packed, bits, numel)


def sign_bits(x: torch.Tensor, zero_is_positive: bool = True) -> torch.Tensor:
    """Boolean tensor: True where ``x`` counts as +1 (x > 0, or x == 0 with ``zero_is_positive``)."""
    if x.dtype == torch.bool:
        return x
    return x >= 0 if zero_is_positive else x > 0


def pack_signs(
    x: torch.Tensor, zero_is_positive: bool = True, *, bits: int = 1, nbytes: int | None = None
) -> torch.Tensor:
    """Pack the signs of a flat tensor into ``ceil(n/8)`` bytes; zeros follow ``zero_is_positive``.

    ``bits`` > 1 writes each sign as a ``bits``-wide field (1 for +1, 0 for -1), the k-bit "sign"
    quantizer; ``nbytes`` pads the message with zero bytes to that length.
    """
    _check_width(bits)
    flat = x.reshape(-1)
    choice = _path(flat)
    if choice.path == "compiled" and flat.dtype in _SIGN_DTYPES:
        flat = flat.contiguous()
        out = _new_bytes(_out_bytes(flat.numel(), bits, nbytes), flat)
        choice.module.pack_signs(flat, zero_is_positive, bits, out)
        return out
    return pack_fields(sign_bits(flat, zero_is_positive), bits, nbytes=nbytes)


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
    choice = _path(packed)
    if choice.path == "compiled" and dtype in _UNPACK_DTYPES and packed.dtype == torch.uint8:
        flat = packed.reshape(-1).contiguous()
        if flat.numel() * 8 < numel:
            raise ValueError(f"{flat.numel()} bytes hold fewer than {numel} signs")
        target = torch.empty(numel, dtype=dtype, device=packed.device) if out is None else out.view(-1)
        choice.module.unpack_signs(flat, target)
        return target if out is None else out
    signs = unpack_fields(packed, 1, numel).to(dtype).mul_(2).sub_(1)
    return signs if out is None else out.copy_(signs.view(out.shape))


def sum_fields_per_position(packed_rows: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """For a ``(p, nbytes)`` stack of packed b-bit messages, the int32 sum of the p fields at each position."""
    _check_width(bits)
    choice = _path(packed_rows)
    if choice.path == "compiled" and packed_rows.dtype == torch.uint8 and packed_rows.dim() == 2:
        rows = packed_rows.contiguous()
        if rows.size(1) * 8 < numel * bits:
            raise ValueError(f"rows of {rows.size(1)} bytes hold fewer than {numel} {bits}-bit fields")
        out = torch.empty(numel, dtype=torch.int32, device=packed_rows.device)
        choice.module.sum_fields(rows, bits, numel, out)
        return out
    sums = torch.zeros(numel, dtype=torch.int32, device=packed_rows.device)
    for row in packed_rows:
        sums.add_(unpack_fields(row, bits, numel))
    return sums


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
    if packed_rows.dim() != 2:
        raise ValueError(f"packed_rows must be a (p, nbytes) stack, got shape {tuple(packed_rows.shape)}")
    p = packed_rows.size(0)
    if p < 1:
        raise ValueError("vote_packed_signs needs at least one row")
    choice = _path(packed_rows)
    if choice.path == "compiled" and packed_rows.dtype == torch.uint8:
        rows = packed_rows.contiguous()
        if rows.size(1) * 8 < numel:
            raise ValueError(f"rows of {rows.size(1)} bytes hold fewer than {numel} signs")
        out = _new_bytes(packed_length(numel), rows)
        choice.module.vote_packed_signs(rows, numel, zero_is_positive, out)
        return out
    plus_votes = count_set_bits_per_position(packed_rows, numel)
    # vote sum S = 2k - p; S > 0 <=> 2k > p, and S == 0 is a tie.
    vote = 2 * plus_votes >= p if zero_is_positive else 2 * plus_votes > p
    return pack_fields(vote, 1)


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
    if bits not in (2, 4, 8):
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
    choice = _path(flat)
    if choice.path == "compiled" and flat.dtype in _UNPACK_DTYPES:
        flat = flat.contiguous()
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        if sizes:
            torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
        if flat.is_cuda:
            offsets, scales_t = offsets.to(flat.device), scales_t.to(flat.device)
        else:
            scales_t = scales_t.cpu()
        out = _new_bytes(_out_bytes(flat.numel(), bits, nbytes), flat)
        choice.module.quantize_l1_pack(flat, offsets, scales_t.contiguous(), levels, bits, out)
        return out
    fields = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    scales_list = scales_t.tolist()
    start = 0
    for size, scale in zip(sizes, scales_list):
        segment = flat[start : start + size]
        if scale == 0:
            fields[start : start + size] = levels
        else:
            q = torch.round(segment.float() * torch.tensor(scale, dtype=torch.float32, device=flat.device))
            fields[start : start + size] = q.clamp_(-levels, levels).to(torch.int32).add_(levels).to(torch.uint8)
        start += size
    return pack_fields(fields, bits, nbytes=nbytes)


# ====================================================================== pure torch path


def _pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    remainder = x.numel() % multiple
    if remainder == 0:
        return x
    return torch.cat([x, x.new_zeros(multiple - remainder)])


# Multiplying eight 0/1 bytes, read as one little-endian int64, by this constant gathers byte j's
# bit into bit 56 + j without carries, so one multiply and one shift pack eight signs.
_GATHER_EIGHT_BITS = 0x0102040810204080
_REPEAT_BYTE = 0x0101010101010101
_BIT_J_OF_BYTE_J = 0x8040201008040201 - (1 << 64)  # as a signed int64


def _torch_pack_fields(flat: torch.Tensor, bits: int) -> torch.Tensor:
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat.to(torch.uint8)
    if bits == 8:
        return flat.clone()
    # Read each byte group as one wider integer and move its fields together with shifts.
    grouped = _pad_to_multiple(flat, 8 // bits).contiguous()
    if grouped.storage_offset() % (8 // bits) != 0:
        grouped = grouped.clone()  # a wide-integer view needs an aligned start
    if bits == 1:
        words = grouped.view(torch.int64)
        return ((words * _GATHER_EIGHT_BITS) >> 56).to(torch.uint8)
    if bits == 2:
        words = grouped.view(torch.int32)
        return (words | (words >> 6) | (words >> 12) | (words >> 18)).to(torch.uint8)
    words = grouped.view(torch.int16)
    return (words | (words >> 4)).to(torch.uint8)


def _torch_unpack_fields(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 8:
        return packed[:numel].clone()
    if bits == 1:
        # Copy each byte into all eight bytes of an int64, keep bit j in byte j, test for non-zero.
        words = packed.to(torch.int64) * _REPEAT_BYTE
        words.bitwise_and_(_BIT_J_OF_BYTE_J)
        return words.view(torch.uint8).ne(0).view(torch.uint8)[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    fields = (packed.reshape(-1, 1) >> shifts).bitwise_and_(mask)
    return fields.reshape(-1)[:numel]


# ====================================================================== cupy path (CUDA tensors)


def _cupy_pack_bits(cupy: Any, flat: torch.Tensor) -> torch.Tensor:
    bits = flat if flat.dtype == torch.bool else flat.to(torch.uint8).bitwise_and_(1).bool()
    if bits.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    packed = cupy.packbits(cupy.from_dlpack(bits.contiguous()), bitorder="little")
    return torch.from_dlpack(packed)


def _cupy_unpack_bits(cupy: Any, packed: torch.Tensor, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8, device=packed.device)
    source = packed.reshape(-1)[: packed_length(numel)].contiguous()
    bits = cupy.unpackbits(cupy.from_dlpack(source), bitorder="little")
    return torch.from_dlpack(bits)[:numel]


__all__ = [
    "FIELD_WIDTHS",
    "PACKING_ENV",
    "PACKING_MODES",
    "PackingPath",
    "count_set_bits_per_position",
    "pack_fields",
    "pack_l1_fields",
    "pack_signs",
    "packed_length",
    "packing_path",
    "requested_mode",
    "set_packing_path",
    "sign_bits",
    "sum_fields_per_position",
    "unpack_fields",
    "unpack_signs",
    "vote_packed_signs",
]
