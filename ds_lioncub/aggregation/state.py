"""What an aggregation works on and keeps: the bucket, and the state that survives from one step to the next.

:class:`Bucket` is what every aggregation stage takes (:mod:`ds_lioncub.aggregation`); each aggregation
owns an :class:`AggregationState` (one subclass per kind, its docstring says how to tune each knob), which
is where per-bucket state such as error feedback (:mod:`ds_lioncub.aggregation.error_feedback`) lives and what a
checkpoint saves (``state_dict()``/``load_state_dict()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.comm.vocabulary import Aggregation as AggregationKind

#: See :attr:`Bucket.key`.
BucketKey = tuple[int, int]


@dataclass
class Bucket:
    """One bucket of a step: flat fp32 values cut into parameter pieces.

    Attributes:
        values: the ranks' local values, contiguous fp32: gradients for :class:`ExactMean`,
            pre-sign updates ``c`` for the votes.
        piece_sizes: elements of each parameter piece, in order; they add up to ``values.numel()``.
        piece_mean_abs: for the L1 quantizer, mean |c| of the WHOLE tensor a piece was cut from
            (``None`` where the piece is a whole tensor: its own mean is used). Empty otherwise.
        key: the bucket's identity from one step to the next, where an aggregation keeps per-bucket state
            (error feedback): the index of its first piece's tensor among the step's entries and that
            piece's offset in the tensor. The bucket plan is a function of the participating tensors'
            sizes, so the key names the same elements every step while they do not change.
            ``None`` where no state is kept (exact means, momentum sync).
    """

    values: torch.Tensor
    piece_sizes: list[int]
    piece_mean_abs: list[torch.Tensor | None]
    key: BucketKey | None = None


class AggregationState:
    """What an aggregation keeps from one step to the next, in the shape of PyTorch's ``PowerSGDState``
    for DDP communication hooks: the knobs that fix its results, per-bucket state, and counters.

    Without error feedback every aggregation is memoryless: a bucket's result is a function of that step's
    messages and tie rule only. The tie rule is not kept here: the optimizer passes it to each call, derived from
    its step count (``tie_break``), which the optimizer's own state already checkpoints. So the state
    holds:

    - the knobs (:meth:`knobs`; one subclass per aggregation says what they are and how to tune them),
      fixed at construction and checked by :meth:`load_state_dict`;
    - :attr:`buckets`: per-bucket tensors by the bucket's :attr:`Bucket.key`. Empty without error
      feedback, which keeps each bucket's residual or estimates there (:mod:`ds_lioncub.aggregation.error_feedback`);
    - :attr:`issued`: the buckets whose first collective this rank issued (every ``start``/``issue``),
      a counter for diagnostics that no result depends on.

    :meth:`state_dict` and :meth:`load_state_dict` make it checkpointable: each rank's checkpoint file
    carries it where it holds per-bucket state (error feedback; docs/design.md, section 11.5).
    """

    def __init__(self) -> None:
        self.buckets: dict[BucketKey, dict[str, torch.Tensor]] = {}
        self.issued = 0

    def knobs(self) -> dict[str, Any]:
        """The options that fix this aggregation's results, as plain values."""
        return {}

    @property
    def feedback_kind(self) -> str | None:
        """The error feedback this state keeps ("residual", "ef21"), None without."""
        return None

    def take_feedback_ratio(self) -> float | None:
        """The error feedback's telemetry since the last call (:mod:`ds_lioncub.aggregation.error_feedback`);
        None without."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The state as plain values and tensors (the per-bucket tensors are not copied)."""
        return {
            "kind": type(self).__name__,
            "knobs": self.knobs(),
            "issued": self.issued,
            "buckets": {index: dict(tensors) for index, tensors in self.buckets.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over ``state`` (from :meth:`state_dict` of an aggregation of the same kind and knobs).

        Raises ValueError when the kind or a knob differs: a residual kept under other knobs means
        something else. The per-bucket tensors are taken as they are (not copied, not moved).
        """
        kind, knobs = state.get("kind"), state.get("knobs")
        if kind != type(self).__name__ or knobs != self.knobs():
            raise ValueError(
                f"cannot load the state of {kind} with knobs {knobs} into "
                f"{type(self).__name__} with knobs {self.knobs()}"
            )
        self.issued = int(state["issued"])
        self.buckets = {_bucket_key(key): dict(tensors) for key, tensors in state["buckets"].items()}


def _bucket_key(key: Any) -> BucketKey:
    """A :attr:`Bucket.key` as saved (a tuple, or the list a serializer may have made of it)."""
    tensor_index, offset = key
    return int(tensor_index), int(offset)


class ExactMeanState(AggregationState):
    """The state of :class:`ExactMean`: its one knob, and (empty) per-bucket state.

    Knob: ``comm_dtype``: fp32 is exact; bf16 halves the bytes and rounds each rank's contribution and
    the sum to bf16's 8 significant bits, which Lion's sign usually shrugs off for gradients.
    """

    def __init__(self, comm_dtype: torch.dtype) -> None:
        super().__init__()
        self.comm_dtype = comm_dtype

    def knobs(self) -> dict[str, Any]:
        return {"comm_dtype": str(self.comm_dtype)}


class OneBitVoteState(AggregationState):
    """The state of :class:`OneBitVote`: no knob (the tie rule comes with each step), (empty) per-bucket
    state. Its only tuning is the optimizer's ``bucket_size`` (see :class:`KbitVoteState`)."""


class KbitVoteState(AggregationState):
    """The state of :class:`KbitVote`: its knobs, and (empty) per-bucket state.

    Knobs:

    - ``codec`` (``bits``, ``quantizer``, ``kbit_algorithm``): 2, 4 or 8 bits per element on the wire.
      With the sign quantizer more bits only buy a larger all-reduce world (``2**bits - 1`` ranks);
      with L1 they buy resolution (``L = floor((2**bits - 1) / (2p))`` levels under all-reduce,
      ``(2**bits - 1) // 2`` under all-to-all). Start with 4-bit sign; move to 8-bit L1 when the vote
      loses quality. "allreduce" sends ``2 (p-1)/p * n * bits/8`` bytes in one collective but holds
      only small worlds; "alltoall" holds any world, sends ``(p-1)/p * n * (bits + 1)/8`` for a vote,
      and keeps L1's levels independent of ``p``.
    - ``aggregation``: "vote" applies the sign of the sum (±1, Lion's update size); "mean" applies the
      sum over its largest magnitude, a smaller step where the ranks disagree.
    - ``l1_clip`` (tau): the L1 quantizer saturates at tau * mean|c|. 2 is the paper's setting; larger
      keeps more outliers at the cost of resolution near zero.
    - ``bucket_size`` (the optimizer's, all modes): elements per collective. Larger buckets mean fewer,
      larger messages (less latency per byte) and larger temporaries (about one bucket, more for L1).
    """

    def __init__(self, codec: KbitCodec, aggregation: AggregationKind, l1_clip: float) -> None:
        super().__init__()
        self.codec = codec
        self.aggregation = aggregation
        self.l1_clip = l1_clip

    def knobs(self) -> dict[str, Any]:
        codec = self.codec
        return {
            "bits": codec.bits,
            "quantizer": codec.quantizer,
            "algorithm": codec.algorithm,
            "aggregation": self.aggregation,
            "l1_clip": self.l1_clip,
        }


__all__ = [
    "AggregationState",
    "Bucket",
    "BucketKey",
    "ExactMeanState",
    "KbitVoteState",
    "OneBitVoteState",
]
