"""The 1-bit vote (``compression="1bit"``): every rank sends the sign of its update, one bit per element, and
applies the majority.

It takes every option of the votes and none of the k-bit fields'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_lioncub.aggregation.one_bit_vote import OneBitVote
from ds_lioncub.comm import wire
from ds_lioncub.modes.record import UNMEASURED, VOTE_OPTIONS, VOTE_SHOWN, ModeRecord, sign_vote_study_key


def _study_key(params: Mapping[str, Any]) -> str:
    if params.get("error_feedback"):  # the study measured error feedback apart, not as planner evidence
        return UNMEASURED
    return sign_vote_study_key(params)


ONE_BIT = ModeRecord(
    name="1bit",
    exact=False,
    votes=True,
    takes=VOTE_OPTIONS,
    shown_options=lambda options: VOTE_SHOWN,
    build_aggregation=lambda options, transport, gradients_averaged: OneBitVote(transport),
    collectives=lambda options, numel, world_size: wire.vote_1bit_collectives(numel, world_size),
    message_bytes=lambda options, numel, world_size: wire.sign_vote_message_bytes(numel, world_size),
    local_cost_key=lambda options: "1bit",
    study_key=_study_key,
)

__all__ = ["ONE_BIT"]
