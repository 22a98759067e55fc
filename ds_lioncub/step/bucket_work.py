"""A bucket's local work around its aggregation: Lion's pre-sign updates before, the update after.

A step cuts the participating parameters into buckets (:mod:`ds_lioncub.step.bucket_plan`); each bucket's
values go through an aggregation (:mod:`ds_lioncub.aggregation`) between two local halves, written
here once for every caller that steps replicas: :class:`~ds_lioncub.optimizer.LionCub` (one rank) and
:class:`~ds_lioncub.simulate.VirtualLionCub` (N workers in one process). Both run these functions on
the same slices in the same order, so both compute the same bits.

- before a vote: :func:`prepare_bucket` (:func:`bucket_directions`, the fp32 ``c`` of every piece,
  then :func:`update_bucket_momenta`), or for a sign vote :func:`prepare_sign_message` (both, and the
  packing, one pass where compiled);
- after it: :func:`apply_bucket` (an unpacked result) or :func:`apply_voted_signs` (packed signs);
- exact Lion: :func:`exact_lion_bucket` (on the ranks' mean, which the step's aggregation takes);
- the L1 quantizer's whole-tensor scale: :func:`whole_tensor_mean_abs`;
- the non-finite check's local half: :func:`non_finite_parameters`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ds_lioncub.aggregation import Aggregator, Bucket
from ds_lioncub.comm.packing import MomentumPiece, ParamPiece, apply_packed_signs, lion_direction_pack_signs
from ds_lioncub.config import parse_config
from ds_lioncub.errors import LionCubConfigError, UnsupportedParameterError
from ds_lioncub.lion import apply_update, lion_direction, update_momentum
from ds_lioncub.step.bucket_plan import Piece


class Entry(NamedTuple):
    """A parameter taking part in a step, with one worker's gradient and momentum."""

    group: dict[str, Any]
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor


def check_param_group(group: dict[str, Any]) -> None:
    """Raise unless a step can serve ``group`` (as torch.optim stores it, defaults filled in): its lr, betas
    and weight decay valid as options, every parameter dense, floating-point and contiguous (steps update
    flat views)."""
    parse_config({key: group[key] for key in ("lr", "betas", "weight_decay")})
    names = group.get("param_names", [None] * len(group["params"]))
    for name, param in zip(names, group["params"], strict=True):
        label = f"parameter {name!r}" if name else f"a parameter of shape {tuple(param.shape)}"
        if not param.is_floating_point():
            raise UnsupportedParameterError(
                f"LionCub: {label} has dtype {param.dtype}; only floating-point parameters can be "
                f"optimized. Leave it out of the optimizer or set requires_grad=False."
            )
        if param.is_sparse:
            raise UnsupportedParameterError(f"LionCub: {label} is a sparse tensor; LionCub needs dense parameters.")
        if not param.is_contiguous():
            raise LionCubConfigError(
                f"LionCub: {label} is not contiguous; LionCub updates flat views. "
                f"Make it contiguous (param.data = param.data.contiguous()) before building the optimizer."
            )


def piece_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The flat elements of ``tensor`` that ``piece`` covers, as a view to write through.

    ``view`` (not ``reshape``): a non-contiguous tensor must fail loudly, not update a silent copy.
    """
    return tensor.view(-1)[piece.start : piece.start + piece.length]


def grad_piece(grad: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of a gradient that ``piece`` covers; only read, so any layout will do."""
    return grad.reshape(-1)[piece.start : piece.start + piece.length]


class BucketBuffers:
    """One fp32 buffer per device, as large as the largest bucket of ``plan``, that a step's buckets take turns in."""

    def __init__(self, plan: list[list[Piece]]) -> None:
        self.numel = max((sum(piece.length for piece in bucket) for bucket in plan), default=0)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def for_bucket(self, entries: Sequence[Entry], bucket: list[Piece]) -> torch.Tensor:
        device = entries[bucket[0].tensor_index].param.device
        buffer = self._by_device.get(device)
        if buffer is None:
            buffer = self._by_device[device] = torch.empty(self.numel, dtype=torch.float32, device=device)
        return buffer[: sum(piece.length for piece in bucket)]


def bucket_directions(
    entries: Sequence[Entry] | Mapping[int, Entry],
    bucket: list[Piece],
    out: torch.Tensor,
    whole_mean_abs: dict[int, torch.Tensor],
    aggregator: Aggregator,
    first_key_tensor: int = 0,
) -> Bucket:
    """The bucket's pre-sign updates ``c`` into ``out``, as a :class:`Bucket`; nothing else is written.
    ``first_key_tensor``: the number ``entries[0]`` has in the bucket's key."""
    sizes = [piece.length for piece in bucket]
    for piece, direction in zip(bucket, out.split(sizes), strict=True):
        entry = entries[piece.tensor_index]
        lion_direction(
            piece_of(entry.exp_avg, piece), grad_piece(entry.grad, piece), entry.group["betas"][0], out=direction
        )
    mean_abs = (
        [whole_mean_abs.get(piece.tensor_index) for piece in bucket] if aggregator.needs_whole_tensor_mean_abs else []
    )
    return Bucket(out, sizes, mean_abs, key=(first_key_tensor + bucket[0].tensor_index, bucket[0].start))


def prepare_bucket(
    entries: Sequence[Entry],
    bucket: list[Piece],
    scratch: BucketBuffers,
    whole_mean_abs: dict[int, torch.Tensor],
    aggregator: Aggregator,
    first_key_tensor: int = 0,
) -> Bucket:
    """The bucket's pre-sign updates ``c`` (in ``scratch``), its momenta updated: the local work before the vote."""
    out = scratch.for_bucket(entries, bucket)
    prepared = bucket_directions(entries, bucket, out, whole_mean_abs, aggregator, first_key_tensor)
    update_bucket_momenta(entries, bucket)
    return prepared


def update_bucket_momenta(entries: Sequence[Entry], bucket: list[Piece]) -> None:
    """The momentum EMA of the bucket's pieces (piece by piece: the same slices, hence bits, in every schedule)."""
    for piece in bucket:
        entry = entries[piece.tensor_index]
        update_momentum(piece_of(entry.exp_avg, piece), grad_piece(entry.grad, piece), entry.group["betas"][1])


def apply_bucket(entries: Sequence[Entry], bucket: list[Piece], delta: torch.Tensor) -> None:
    """The agreed update ``delta`` applied to the bucket's parameters: the local work after the vote."""
    for piece, piece_delta in zip(bucket, delta.split([piece.length for piece in bucket]), strict=True):
        entry = entries[piece.tensor_index]
        apply_update(piece_of(entry.param, piece), piece_delta, entry.group["lr"], entry.group["weight_decay"])


def prepare_sign_message(
    entries: Sequence[Entry], bucket: list[Piece], positive_ties: bool, bits: int, nbytes: int
) -> torch.Tensor:
    """A bucket's local work before a sign vote: its packed sign message (``bits``-wide fields, ``nbytes``
    bytes) of Lion's direction ``c``, with the bucket's momenta updated (``lion_direction``, then
    ``update_momentum``, then ``pack_signs``, fused where the packing path has the kernels)."""
    pieces = []
    for piece in bucket:
        entry = entries[piece.tensor_index]
        beta1, beta2 = entry.group["betas"]
        pieces.append(MomentumPiece(piece_of(entry.exp_avg, piece), grad_piece(entry.grad, piece), beta1, beta2))
    return lion_direction_pack_signs(pieces, positive_ties, bits=bits, nbytes=nbytes)


def apply_voted_signs(entries: Sequence[Entry], bucket: list[Piece], voted: torch.Tensor) -> None:
    """A bucket's local work after a sign vote: each parameter piece updated by its voted signs (packed,
    one bit per element), as ``apply_update`` with the signs unpacked to ±1 (fused where compiled)."""
    pieces = []
    for piece in bucket:
        entry = entries[piece.tensor_index]
        pieces.append(ParamPiece(piece_of(entry.param, piece), entry.group["lr"], entry.group["weight_decay"]))
    apply_packed_signs(voted, pieces)


def exact_lion_bucket(entries: Sequence[Entry], bucket: list[Piece], grads: list[torch.Tensor]) -> None:
    """Exact Lion on a bucket: ``sign(c)`` from each piece's (averaged) gradient in ``grads`` applied, and
    the piece's momentum updated with it."""
    for piece, grad in zip(bucket, grads, strict=True):
        entry = entries[piece.tensor_index]
        beta1, beta2 = entry.group["betas"]
        exp_avg_slice = piece_of(entry.exp_avg, piece)
        direction = torch.sign(lion_direction(exp_avg_slice, grad, beta1))
        apply_update(piece_of(entry.param, piece), direction, entry.group["lr"], entry.group["weight_decay"])
        update_momentum(exp_avg_slice, grad, beta2)


def non_finite_parameters(entries: Sequence[Entry]) -> list[torch.Tensor]:
    """The parameters whose gradient holds a NaN or inf on this rank."""
    # A sum is NaN/inf exactly when some element is (short of an fp32 overflow of the sum, itself a
    # broken gradient): one read pass per tensor, no per-element temporary, one host sync.
    sums = [entry.grad.sum(dtype=torch.float32) for entry in entries]
    if not sums or bool(torch.isfinite(torch.stack(sums)).all()):
        return []
    return [entry.param for entry, total in zip(entries, sums, strict=True) if not torch.isfinite(total)]


def whole_tensor_mean_abs(entries: Sequence[Entry], capacity: int) -> dict[int, torch.Tensor]:
    """The L1 quantizer's mu (mean |c| of the whole tensor) of every tensor cut across buckets, by entry
    index: needed up front, before the first bucket holding a piece of it."""
    return {
        index: mean_abs_direction(entry, capacity)
        for index, entry in enumerate(entries)
        if entry.param.numel() > capacity
    }


def mean_abs_direction(entry: Entry, chunk: int) -> torch.Tensor:
    """mean |c| over the whole tensor, computed ``chunk`` elements at a time (temporaries stay bucket-sized)."""
    beta1 = entry.group["betas"][0]
    total = torch.zeros((), dtype=torch.float32, device=entry.exp_avg.device)
    flat_m, flat_g = entry.exp_avg.reshape(-1), entry.grad.reshape(-1)
    for start in range(0, flat_m.numel(), chunk):
        total += lion_direction(flat_m[start : start + chunk], flat_g[start : start + chunk], beta1).abs().sum()
    return total / flat_m.numel()


__all__ = [
    "BucketBuffers",
    "Entry",
    "apply_bucket",
    "apply_voted_signs",
    "bucket_directions",
    "check_param_group",
    "exact_lion_bucket",
    "grad_piece",
    "mean_abs_direction",
    "non_finite_parameters",
    "piece_of",
    "prepare_bucket",
    "prepare_sign_message",
    "update_bucket_momenta",
    "whole_tensor_mean_abs",
]
