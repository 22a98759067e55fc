"""Bits per gradient element: what each rank's message costs per element, for the planner's table and the
convergence study's cells (benchmarks/study_evidence.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_lioncub.comm import wire
from ds_lioncub.config import parse_config
from ds_lioncub.modes import mode_of

#: Exact Lion's bits per element by its all-reduce's dtype.
EXACT_BITS = {"fp32": 32, "bf16": 16}


def bits_per_element(params: Mapping[str, Any], workers: int) -> int:
    """Bits per gradient element of the message each of ``workers`` ranks sends for LionCub ``params``: 1 for the
    1-bit vote, b for a b-bit vote; exact Lion's all-reduce dtype (32 or 16). Counted by ds_lioncub.comm.wire
    (what the transports and the planner count) on a bucket of 8 x ``workers`` elements, which needs no padding.

    Momentum sync (docs/design.md, section 8) is not in the figure: every ``interval`` K steps it all-reduces
    the selected layers' momenta, 2(p - 1)/p x 32 bits (fp32; 16 in bf16) per selected element, so it adds
    2(p - 1)/p x 32 x (n_sel / n) / K bits per element per step on average, with n_sel / n the share of the
    model's elements in the embeddings and head (``layers: "auto"``), which depends on the model.
    """
    options = parse_config(dict(params))
    mode = mode_of(options)
    if mode.chosen_by_planner:
        raise ValueError(f"bits_per_element: {options.compression!r} sends no vote")
    numel = wire.vote_padded_numel(1, workers)
    return 8 * mode.message_bytes(options, numel, workers) // numel


__all__ = ["EXACT_BITS", "bits_per_element"]
