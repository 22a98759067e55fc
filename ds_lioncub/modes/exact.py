"""Exact Lion (``compression="none"``): the ranks average their gradients in one all-reduce, then step alike.

Nothing is voted, so every option of the votes is refused here, and the gradient all-reduce's dtype
(``comm_dtype``) is the one option of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_lioncub.aggregation.base import Aggregator
from ds_lioncub.aggregation.exact_mean import COMM_DTYPES, ExactMean
from ds_lioncub.comm import wire
from ds_lioncub.comm.transport import Transport
from ds_lioncub.modes.record import ModeOptions, ModeRecord

#: Bytes per gradient element on the wire, by the all-reduce's dtype (``comm_dtype``).
ELEMENT_SIZE = {"fp32": 4, "bf16": 2}


def _exact_mean(options: ModeOptions, transport: Transport, gradients_averaged: bool) -> Aggregator | None:
    """The mean over the ranks; none where there is nothing to average (one rank) or the caller (DeepSpeed's
    engine) averaged the gradients already."""
    if transport.world_size == 1 or gradients_averaged:
        return None
    return ExactMean(transport, COMM_DTYPES[options.comm_dtype])


def _no_study_key(params: Mapping[str, Any]) -> None:
    """Exact Lion is what the study compares every mode with: it has no cell of its own."""
    return None


EXACT = ModeRecord(
    name="none",
    exact=True,
    votes=False,
    takes=frozenset({"comm_dtype"}),
    shown_options=lambda options: ("comm_dtype",),
    build_aggregation=_exact_mean,
    collectives=lambda options, numel, world_size: wire.dense_all_reduce_collectives(
        numel, world_size, ELEMENT_SIZE[options.comm_dtype]
    ),
    message_bytes=lambda options, numel, world_size: numel * ELEMENT_SIZE[options.comm_dtype],
    local_cost_key=lambda options: f"none/{options.comm_dtype}",
    study_key=_no_study_key,
)

__all__ = ["ELEMENT_SIZE", "EXACT"]
