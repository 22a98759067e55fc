"""How the ranks' buckets become one result: exact mean, 1-bit vote, or k-bit sums.

:func:`build_aggregation` is the face: it builds, once, from the validated options and the transport, the
aggregation a step runs every bucket through (all option checks, the world-size limits of the k-bit fields
included, happen there). One file per job:

- :mod:`~ds_lioncub.aggregation.base`: the stages every aggregation offers (:class:`Aggregator`) and those
  the votes share (:class:`~ds_lioncub.aggregation.base.VoteStages`);
- :mod:`~ds_lioncub.aggregation.exact_mean`, :mod:`~ds_lioncub.aggregation.one_bit_vote`,
  :mod:`~ds_lioncub.aggregation.kbit_vote`: the three kinds;
- :mod:`~ds_lioncub.aggregation.state`: :class:`Bucket`, what the stages take, and each kind's state
  (:class:`AggregationState`: knobs, per-bucket state, ``state_dict()``);
- :mod:`~ds_lioncub.aggregation.error_feedback`: error feedback on the k-bit L1 fields, k-bit votes that keep
  per-bucket state (docs/design.md section 4.8).

A new aggregation is a new file here implementing :class:`Aggregator`, with its state in ``state.py``; the mode
that runs it builds it (its record's ``build_aggregation``, :mod:`ds_lioncub.modes`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ds_lioncub.aggregation.base import Aggregator, VoteStages
from ds_lioncub.aggregation.exact_mean import COMM_DTYPES, ExactMean
from ds_lioncub.aggregation.kbit_vote import KbitVote, piece_means
from ds_lioncub.aggregation.one_bit_vote import OneBitVote
from ds_lioncub.aggregation.state import (
    AggregationState,
    Bucket,
    BucketKey,
    ExactMeanState,
    KbitVoteState,
    OneBitVoteState,
)
from ds_lioncub.comm.transport import Transport
from ds_lioncub.errors import LionCubConfigError

if TYPE_CHECKING:
    from ds_lioncub.config import LionCubConfig

#: A vote of sign fields or k-bit fields (what :func:`packed_sign_vote` answers).
Vote = OneBitVote | KbitVote


def packed_sign_vote(aggregator: Aggregator) -> Vote | None:
    """``aggregator`` when it is a vote of sign fields (1-bit vote, k-bit vote of signs), else None.

    .. deprecated:: ask the aggregation instead: ``aggregator.votes_packed_signs``.
    """
    warnings.warn(
        "packed_sign_vote(aggregator) is deprecated: ask aggregator.votes_packed_signs",
        DeprecationWarning,
        stacklevel=2,
    )
    if isinstance(aggregator, (OneBitVote, KbitVote)) and aggregator.votes_packed_signs:
        return aggregator
    return None


def build_aggregation(options: LionCubConfig, transport: Transport, gradients_averaged: bool) -> Aggregator | None:
    """The aggregation ``options`` ask for over ``transport``, validated for its world size.

    ``None`` means the gradients are used as they are: exact Lion alone, or on gradients the
    caller (DeepSpeed's engine) has already averaged. Raises :class:`~ds_lioncub.errors.LionCubConfigError`
    (on every rank alike: the inputs are the same everywhere) when the k-bit fields cannot hold the world.
    """
    # Imported here: the modes' records are built on this package's aggregations, and the config's rules on the
    # records, so this package must be importable before either (error feedback reads the config's block).
    from ds_lioncub.aggregation.error_feedback import build_error_feedback
    from ds_lioncub.modes import mode_of

    aggregator = mode_of(options).build_aggregation(options, transport, gradients_averaged)
    feedback = options.error_feedback
    if feedback is None:
        return aggregator
    # Error feedback keeps state on the k-bit L1 fields the mode built (the config refuses it with any other
    # mode): the same codec and knobs, with the feedback on top.
    if not isinstance(aggregator, KbitVote):
        raise LionCubConfigError(
            f"LionCub: error_feedback needs k-bit fields, and compression={options.compression!r} built {aggregator!r}."
        )
    return build_error_feedback(transport, aggregator.codec, aggregator.aggregation, aggregator.l1_clip, feedback)


__all__ = [
    "COMM_DTYPES",
    "AggregationState",
    "Aggregator",
    "Bucket",
    "BucketKey",
    "ExactMean",
    "ExactMeanState",
    "KbitVote",
    "KbitVoteState",
    "OneBitVote",
    "OneBitVoteState",
    "Vote",
    "VoteStages",
    "build_aggregation",
    "packed_sign_vote",
    "piece_means",
]
