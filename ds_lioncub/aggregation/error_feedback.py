"""Error feedback on the k-bit L1 path: the residual form and the shared-scale EF21 form.

Both are k-bit L1 aggregations (:class:`~ds_lioncub.aggregation.KbitVote`) whose per-bucket state
(:class:`~ds_lioncub.aggregation.AggregationState`, keyed by :attr:`~ds_lioncub.aggregation.Bucket.key`)
survives from one step to the next; docs/design.md, section 4.8 states the algorithms and why every
rank applies the same bits.

- :class:`KbitVoteResidual` (``kind="residual"``): rank i quantizes ``h = c + e`` with the L1 scale the
  plain path uses (mean |c| of the whole tensor), sends the levels ``q``, and keeps
  ``e <- beta * e + (1 - beta) * (h - q / s)`` (``feed_back="rounding"``: ``h`` clipped to ``[-L/s, L/s]``
  first). Only the message changes, so any k-bit L1 aggregation (all-reduce or all-to-all, vote or mean)
  serves it.
- :class:`KbitVoteEf21` (``kind="ef21"``): rank i keeps ``G_i``, its estimate of its own ``c``; each
  chunk's owner keeps its chunk of the shared estimate ``G`` (the only copy, so "the same on every
  rank" holds trivially). Per bucket: an all-gather of every rank's mean ``|c - G_i|`` per piece gives
  ``sigma`` (their maximum) and the level step ``u = l1_clip * sigma / L``, the same bits everywhere;
  ``d_i = clamp(round((c - G_i) / u), -L, L)`` is sent as L1 fields; ``G_i += u * d_i``; the owner sums
  the ``d`` exactly in int32 and sets ``G += u * sum(d) / p``; the update is ``sign(G)`` with the tie
  rule, all-gathered as one bit per element, like the k-bit vote's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_lioncub.aggregation.kbit_vote import KbitVote, piece_means
from ds_lioncub.aggregation.state import Bucket, BucketKey, KbitVoteState
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.packing import pack_fields, sum_fields_per_position, unpack_signs
from ds_lioncub.comm.quantize import l1_segment_scales
from ds_lioncub.comm.transport import InFlight, Transport
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind
from ds_lioncub.comm.votes import PendingAggregate, PendingResult, start_kbit_sum
from ds_lioncub.comm.wire import kbit_message_bytes, vote_padded_numel
from ds_lioncub.config import ErrorFeedbackConfig

RESIDUAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _key_of(bucket: Bucket) -> BucketKey:
    if bucket.key is None:
        raise ValueError("error feedback keeps state per bucket: the Bucket needs its key (bucket_directions sets it)")
    return bucket.key


class _FeedbackState(KbitVoteState):
    """A k-bit state whose knobs also name the error feedback and the world size (a residual or estimate
    kept over another world, or under other knobs, means something else: loading it is refused)."""

    def __init__(self, codec: KbitCodec, aggregation: AggregationKind, l1_clip: float, feedback: ErrorFeedbackConfig):
        super().__init__(codec, aggregation, l1_clip)
        self.feedback = feedback
        # Since the last take_feedback_ratio(): the sums of squares of what is fed back and of c (fp64, on device).
        self._squares: torch.Tensor | None = None

    @property
    def feedback_kind(self) -> str | None:
        return self.feedback.kind

    def add_squares(self, fed_back: torch.Tensor, update: torch.Tensor) -> None:
        """Count one bucket in the telemetry's ratio: ``||fed_back||^2`` and ``||update||^2`` (no host sync)."""
        self.add_sums_of_squares(_sum_of_squares(fed_back), _sum_of_squares(update))

    def add_sums_of_squares(self, fed_back: torch.Tensor, update: torch.Tensor) -> None:
        squares = torch.stack([fed_back, update])
        self._squares = squares if self._squares is None else self._squares + squares

    def take_feedback_ratio(self) -> float | None:
        """``sqrt(sum ||fed_back||^2 / sum ||c||^2)`` over the buckets since the last call (one host sync), and
        start counting again; None when no bucket was counted or c was 0. The residual form counts its
        residual e after the step; EF21 the part of c its own estimate still misses, ``c - G_i`` after the
        update: the proxy of ``|G - mean c|`` that one rank can compute."""
        squares, self._squares = self._squares, None
        if squares is None:
            return None
        fed_back, update = squares.tolist()
        return None if update == 0 else (fed_back / update) ** 0.5

    def knobs(self) -> dict[str, Any]:
        feedback: dict[str, Any] = {"kind": self.feedback.kind}
        if self.feedback.kind == "residual":
            feedback |= {
                "beta": self.feedback.beta,
                "reset_interval": self.feedback.reset_interval,
                "storage": self.feedback.storage,
                "feed_back": self.feedback.feed_back,
            }
        return {**super().knobs(), "world_size": self.codec.world_size, "error_feedback": feedback}

    def slot(self, key: BucketKey, shapes: dict[str, tuple[int, torch.dtype, torch.device]]) -> dict[str, torch.Tensor]:
        """The bucket's state tensors, created as zeros (again, if the bucket's size changed: it then holds
        other elements, and its old state means nothing for them)."""
        slot = self.buckets.get(key)
        if slot is None or any(
            slot[name].numel() != numel or slot[name].dtype != dtype for name, (numel, dtype, _) in shapes.items()
        ):
            slot = {name: torch.zeros(n, dtype=dtype, device=device) for name, (n, dtype, device) in shapes.items()}
            self.buckets[key] = slot
            self.forget(key)
        return slot

    def forget(self, key: BucketKey) -> None:
        """Drop what the state keeps of ``key`` outside its tensors (a new slot starts from nothing)."""


class ResidualState(_FeedbackState):
    """The residual form's state: per bucket, ``residual`` (this rank's ``e``, in the storage dtype), and
    :attr:`uses` (how many steps each bucket has been through since its residual was created: the reset
    clock, a host-side count saved with the state)."""

    def __init__(self, codec: KbitCodec, aggregation: AggregationKind, l1_clip: float, feedback: ErrorFeedbackConfig):
        super().__init__(codec, aggregation, l1_clip, feedback)
        self.uses: dict[BucketKey, int] = {}

    def forget(self, key: BucketKey) -> None:
        self.uses.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "uses": dict(self.uses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.uses = {(int(key[0]), int(key[1])): int(count) for key, count in state.get("uses", {}).items()}


class Ef21State(_FeedbackState):
    """EF21's state: per bucket, ``estimate`` (``G_i``, fp32, the bucket's elements) and ``shared`` (this
    rank's chunk of ``G``, fp32, ``n_pad / p`` elements: the chunk it owns in the all-to-all)."""


class KbitVoteResidual(KbitVote):
    """A k-bit L1 aggregation whose message carries the residual of earlier steps (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        codec: KbitCodec,
        aggregation: AggregationKind,
        l1_clip: float,
        feedback: ErrorFeedbackConfig,
    ) -> None:
        super().__init__(transport, codec, aggregation, l1_clip)
        self.state: ResidualState = ResidualState(codec, aggregation, l1_clip, feedback)

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        """The L1 fields of ``h = c + e``; ``e`` updated with this step's rounding error."""
        feedback = self.state.feedback
        values, levels, sizes = bucket.values, self.codec.levels, bucket.piece_sizes
        _, scales = l1_segment_scales(values, levels, self.l1_clip, sizes, piece_means(bucket))
        slot = self.state.slot(
            _key_of(bucket),
            {"residual": (values.numel(), RESIDUAL_DTYPES[feedback.storage], values.device)},
        )
        residual, uses = slot["residual"], self.state.uses.get(_key_of(bucket), 0)
        if feedback.reset_interval and uses and uses % feedback.reset_interval == 0:
            residual.zero_()
        compensated = values + residual.float()
        # Piece by piece with the piece's scale (a 0-d fp32 tensor): the same fp32 products and quotients as
        # with a per-element scale, without building one.
        on_device, positive = scales.to(values.device), (scales > 0).tolist()
        quantized = torch.empty_like(compensated)
        for h, q, scale in zip(compensated.split(sizes), quantized.split(sizes), on_device, strict=True):
            torch.mul(h, scale, out=q)
        quantized.round_().clamp_(-levels, levels)
        # h - dequant(q), in place of h (dequant(q) = q / s; 0 where s is 0, as q is); with feed_back "rounding"
        # h is first clipped to the levels' range [-L / s, L / s] (nothing to clip where s is 0).
        rounding_only = feedback.feed_back == "rounding"
        for h, q, scale, scaled in zip(
            compensated.split(sizes), quantized.split(sizes), on_device, positive, strict=True
        ):
            if scaled:
                if rounding_only:
                    top = levels / scale
                    h.clamp_(-top, top)
                h.sub_(q / scale)
        # e <- beta * e + (1 - beta) * (h - dequant(q)), evaluated in fp32 and stored in the storage dtype.
        error = compensated.mul_(1 - feedback.beta)
        if residual.dtype == torch.float32:
            residual.mul_(feedback.beta).add_(error)
        else:
            residual.copy_(residual.float().mul_(feedback.beta).add_(error))
        self.state.add_squares(residual, values)
        self.state.uses[_key_of(bucket)] = uses + 1
        fields = quantized.add_(levels).to(torch.uint8)
        return pack_fields(fields, self.codec.bits, nbytes=kbit_message_bytes(self.codec, values.numel()))

    def __repr__(self) -> str:
        return f"KbitVoteResidual(bits={self.codec.bits}, aggregation={self.aggregation!r})"


@dataclass
class _Agreed:
    """What :meth:`KbitVoteEf21.agree` leaves for ``start``: ``c - G_i`` and the all-gather of the spreads."""

    difference: torch.Tensor
    spreads: InFlight
    update_squares: torch.Tensor  # ||c||^2 (fp64), for the telemetry


@dataclass
class Ef21Pending(PendingAggregate):
    """A pending EF21 sum: the k-bit all-to-all, the bucket's key, and the level step of each position of
    this rank's chunk (0 in the padding)."""

    key: BucketKey = (0, 0)
    chunk_step: torch.Tensor | None = None


class KbitVoteEf21(KbitVote):
    """Shared-scale EF21 over the k-bit L1 all-to-all (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        codec: KbitCodec,
        aggregation: AggregationKind,
        l1_clip: float,
        feedback: ErrorFeedbackConfig,
    ) -> None:
        if codec.algorithm != "alltoall" or codec.quantizer != "l1" or aggregation != "vote":
            raise ValueError("EF21 runs on the k-bit L1 all-to-all vote")  # the options' rules refuse it first
        super().__init__(transport, codec, aggregation, l1_clip)
        self.state: Ef21State = Ef21State(codec, aggregation, l1_clip, feedback)
        self._agreed: dict[BucketKey, _Agreed] = {}

    @property
    def agrees_before_start(self) -> bool:
        return True

    def _slot(self, bucket_key: BucketKey, numel: int, device: torch.device) -> dict[str, torch.Tensor]:
        chunk = vote_padded_numel(numel, self.transport.world_size) // self.transport.world_size
        shapes = {"estimate": (numel, torch.float32, device), "shared": (chunk, torch.float32, device)}
        return self.state.slot(bucket_key, shapes)

    def agree(self, bucket: Bucket) -> None:
        """``c - G_i`` kept, and the all-gather of its mean magnitude per piece issued (fp32, one per piece)."""
        values = bucket.values
        slot = self._slot(_key_of(bucket), values.numel(), values.device)
        difference = values - slot["estimate"]
        spreads = torch.stack([piece.abs().mean() for piece in difference.split(bucket.piece_sizes)])
        self._agreed[_key_of(bucket)] = _Agreed(
            difference, self.transport.start_all_gather(spreads), _sum_of_squares(values)
        )

    def pack(self, bucket: Bucket, positive_ties: bool) -> torch.Tensor:
        raise ValueError("EF21's message needs the shared scale: use start(), which agrees on it first")

    def start(self, bucket: Bucket, positive_ties: bool) -> Ef21Pending:
        """The levels ``d_i`` of ``(c - G_i) / u`` sent, ``G_i`` moved by them; reads only the bucket's key and
        piece sizes when :meth:`agree` already took its values."""
        key = _key_of(bucket)
        if key not in self._agreed:
            self.agree(bucket)
        agreed = self._agreed.pop(key)
        p, levels, numel = self.transport.world_size, self.codec.levels, agreed.difference.numel()
        sizes = bucket.piece_sizes
        sigma = self.transport.wait(agreed.spreads).view(p, -1).amax(dim=0)
        steps = sigma.mul(self.l1_clip).div_(levels)  # u per piece, the same bits on every rank
        stepped = (steps > 0).tolist()
        # d = clamp(round(diff / u)), piece by piece with the piece's u (a 0-d tensor); 0 where u is 0.
        quantized = torch.zeros_like(agreed.difference)
        pieces = zip(agreed.difference.split(sizes), quantized.split(sizes), steps, stepped, strict=True)
        for diff, q, step, positive in pieces:
            if positive:
                torch.div(diff, step, out=q)
        quantized.round_().clamp_(-levels, levels)
        estimate = self._slot(key, numel, quantized.device)["estimate"]
        remaining = agreed.difference.split(sizes)  # c - G_i, made c - G_i after the update (telemetry)
        for estimated, left, q, step, positive in zip(
            estimate.split(sizes), remaining, quantized.split(sizes), steps, stepped, strict=True
        ):
            if positive:
                moved = q * step
                estimated.add_(moved)
                left.sub_(moved)
        self.state.add_sums_of_squares(_sum_of_squares(agreed.difference), agreed.update_squares)
        fields = quantized.add_(levels).to(torch.uint8)
        message = pack_fields(fields, self.codec.bits, nbytes=kbit_message_bytes(self.codec, numel))
        chunk_step = _chunk_of_pieces(steps, sizes, p, self.transport.rank, vote_padded_numel(numel, p) // p)
        self.state.issued += 1
        pending = start_kbit_sum(self.transport, self.codec, message, numel, positive_ties)
        return Ef21Pending(pending.received, numel, positive_ties, key, chunk_step)

    def issue(self, message: torch.Tensor, numel: int, positive_ties: bool) -> PendingAggregate:
        raise ValueError("EF21 issues its own message (it needs the bucket's key): use start()")

    def reduce(self, pending: object) -> PendingResult:
        """The owner's ``G += u * sum(d) / p`` on its chunk, and the all-gather of ``sign(G)`` (tie rule), packed."""
        assert isinstance(pending, Ef21Pending) and pending.chunk_step is not None
        p, numel = self.transport.world_size, pending.numel
        rows = self.transport.wait(pending.received).view(p, -1)
        sums = sum_fields_per_position(rows, self.codec.bits, vote_padded_numel(numel, p) // p)
        shared = self._slot(pending.key, numel, rows.device)["shared"]
        shared.add_(self.codec.signed_sum(sums).float().mul_(pending.chunk_step).div_(p))
        voted = shared >= 0 if pending.positive_ties else shared > 0
        gathered = self.transport.start_all_gather(pack_fields(voted, 1))
        return PendingResult(gathered, numel, _unpacked_signs(numel), packed_signs=True)

    def tied_counts(self, pending: object) -> tuple[torch.Tensor, bool]:
        """The positions of this rank's chunk (padding left out) where ``G`` is exactly 0: the tie rule
        decides them. An owner's share."""
        assert isinstance(pending, Ef21Pending)
        numel = pending.numel
        shared = self._slot(pending.key, numel, pending.received.device)["shared"]
        first = self.transport.rank * shared.numel()
        real = max(0, min(shared.numel(), numel - first))
        return (shared[:real] == 0).sum(), True

    def __repr__(self) -> str:
        return f"KbitVoteEf21(bits={self.codec.bits})"


def _sum_of_squares(values: torch.Tensor) -> torch.Tensor:
    """``||values||^2`` in one read pass (fp32 accumulation, then fp64: enough for a telemetry ratio)."""
    return torch.linalg.vector_norm(values.float()).double().square()


def _chunk_of_pieces(values: torch.Tensor, sizes: list[int], world_size: int, rank: int, chunk: int) -> torch.Tensor:
    """Rank ``rank``'s chunk (``chunk`` positions of the padded bucket) of the per-piece ``values`` laid over
    the pieces' elements; 0 in the padding."""
    out = torch.zeros(chunk, dtype=values.dtype, device=values.device)
    first, offset = rank * chunk, 0
    for value, size in zip(values, sizes, strict=True):
        low, high = max(offset, first), min(offset + size, first + chunk)
        if low < high:
            out[low - first : high - first] = value
        offset += size
    return out


def _unpacked_signs(numel: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda packed, out: unpack_signs(packed, numel, out=out)


def build_error_feedback(
    transport: Transport,
    codec: KbitCodec,
    aggregation: AggregationKind,
    l1_clip: float,
    feedback: ErrorFeedbackConfig,
) -> KbitVote:
    """The k-bit L1 aggregation with ``feedback`` (options already validated by :class:`LionCubConfig`)."""
    if feedback.kind == "residual":
        return KbitVoteResidual(transport, codec, aggregation, l1_clip, feedback)
    return KbitVoteEf21(transport, codec, aggregation, l1_clip, feedback)


__all__ = [
    "RESIDUAL_DTYPES",
    "Ef21Pending",
    "Ef21State",
    "KbitVoteEf21",
    "KbitVoteResidual",
    "ResidualState",
    "build_error_feedback",
]
