"""The k-bit vote (``compression="kbit"``): every rank sends b-bit fields (its sign, or its L1-quantized update),
and the ranks apply the sign of their sum ("vote") or the sum normalised ("mean").

It takes every option of the votes, the fields' own (``bits``, ``quantizer``, ``aggregation``,
``kbit_algorithm``, ``l1_clip``) and error feedback, which only L1 fields have a rounding error for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_lioncub.aggregation.kbit_vote import KbitVote
from ds_lioncub.comm import wire
from ds_lioncub.comm.kbit import KbitCodec
from ds_lioncub.modes.record import (
    UNMEASURED,
    VOTE_OPTIONS,
    VOTE_SHOWN,
    ModeOptions,
    ModeRecord,
    ModeRefusal,
    clip_suffix,
    sign_vote_study_key,
)

#: The options only the k-bit fields read.
FIELD_OPTIONS = frozenset({"bits", "quantizer", "aggregation", "kbit_algorithm", "l1_clip"})


def codec_of(options: ModeOptions, world_size: int) -> KbitCodec:
    """The fields' codec for ``world_size`` ranks; refuses (LionCubConfigError) a world the fields cannot hold."""
    return KbitCodec.build(world_size, options.bits, options.quantizer, options.kbit_algorithm)


def _shown(options: ModeOptions) -> tuple[str, ...]:
    fields = ("bits", "quantizer", "aggregation", "kbit_algorithm")
    return VOTE_SHOWN + fields + (("l1_clip",) if options.quantizer == "l1" else ())


def _study_key(params: Mapping[str, Any]) -> str:
    """A vote of sign fields is the 1-bit vote's arithmetic (the sum of the workers' signs, the same tie rule), so it
    takes the 1-bit vote's cells; L1 fields voted have cells of their own by width and algorithm."""
    if params.get("error_feedback"):  # the study measured error feedback apart, not as planner evidence
        return UNMEASURED
    voted = params.get("aggregation", "vote") == "vote"
    if params.get("quantizer", "sign") == "sign" and voted:
        return sign_vote_study_key(params)
    if params.get("quantizer") == "l1" and voted:
        return f"{params.get('bits', 4)}bit-l1-{params.get('kbit_algorithm', 'allreduce')}{clip_suffix(params)}"
    return UNMEASURED


KBIT = ModeRecord(
    name="kbit",
    exact=False,
    votes=True,
    takes=VOTE_OPTIONS | FIELD_OPTIONS | {"error_feedback"},
    shown_options=_shown,
    build_aggregation=lambda options, transport, gradients_averaged: KbitVote(
        transport, codec_of(options, transport.world_size), options.aggregation, options.l1_clip
    ),
    collectives=lambda options, numel, world_size: wire.kbit_collectives(
        numel, codec_of(options, world_size), options.aggregation
    ),
    message_bytes=lambda options, numel, world_size: wire.kbit_message_bytes(codec_of(options, world_size), numel),
    local_cost_key=lambda options: (
        f"kbit/{options.quantizer}/{options.bits}/{options.kbit_algorithm}/{options.aggregation}"
    ),
    study_key=_study_key,
    refusals=(
        ModeRefusal(
            "error_feedback",
            lambda options, given: options.error_feedback is not None and options.quantizer != "l1",
            lambda options: (
                f"error_feedback only applies to quantizer='l1' (quantizer is {options.quantizer!r}: a sign field "
                f"has no rounding error to feed back); set quantizer='l1' or drop error_feedback"
            ),
        ),
        ModeRefusal(
            "l1_clip",
            lambda options, given: options.quantizer == "sign" and "l1_clip" in given,
            lambda options: "l1_clip only applies to quantizer='l1'; set quantizer='l1' or drop l1_clip",
        ),
    ),
    scales_by_tensor_mean_abs=lambda options: options.quantizer == "l1",
)

__all__ = ["FIELD_OPTIONS", "KBIT", "codec_of"]
