"""The planner's command-line argument types: counts, fractions and rates that argparse reports as it should.

Each raises :class:`~ds_lioncub.errors.LionCubConfigError` with the fix; :func:`argument` turns that into argparse's
"invalid value" message (exit status 2).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ds_lioncub.errors import LionCubConfigError


def argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises LionCubConfigError (argparse then prints the message)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except LionCubConfigError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("LionCub: ")) from None

    convert.__name__ = parse.__name__
    return convert


# Upper bounds of the counts. Planning time grows with the model's buckets (about 20 s for 1e12 parameters on a
# 2-core machine, and the bucket list no longer fits in memory near 1e20), and a count beyond any machine is a typo.
MAX_PARAMS = 10**13
MAX_NODES = 10**6
MAX_RANKS_PER_NODE = 10**4
MAX_THREADS = 10**4
#: What ``--zero-stage`` takes (stage 1 communicates as stage 2 does: the stage-2 candidates cover it).
ZERO_STAGES = (0, 2, 3)


def _as_float(text: str, hint: str = "") -> float:
    """``text`` as a float, or the planner's "is not a number" error with ``hint`` (e.g. " (write 0.9)")."""
    try:
        return float(text)
    except ValueError:
        raise LionCubConfigError(f"LionCub: {text!r} is not a number{hint}") from None


def _count(limit: int, example: str) -> Callable[[str], int]:
    """A parser of a whole number in [1, ``limit``], written as an integer or as a float such as 1.5e9."""

    def count(text: str) -> int:
        value = _as_float(text, f" (write {example})")
        # Checked before int(): int(inf) raises OverflowError and int(nan) a ValueError argparse would report
        # under this function's name.
        if not math.isfinite(value) or value < 1 or value != int(value):
            raise LionCubConfigError(f"LionCub: {text!r} must be a whole number >= 1 (write {example})")
        if value > limit:
            raise LionCubConfigError(f"LionCub: {text!r} is more than the planner takes: at most {limit:,}")
        return int(value)

    return count


params_count = _count(MAX_PARAMS, "1500000000 or 1.5e9")
nodes_count = _count(MAX_NODES, "e.g. 4")
ranks_count = _count(MAX_RANKS_PER_NODE, "e.g. 8")
threads_count = _count(MAX_THREADS, "e.g. 4")


def fraction(text: str) -> float:
    value = _as_float(text, " (write a fraction such as 0.9)")
    if not 0 < value <= 1:
        raise LionCubConfigError(f"LionCub: {text!r} must be a fraction of the link rate in (0, 1]")
    return value


def beta(text: str) -> float:
    value = _as_float(text, " (write beta2 as e.g. 0.99)")
    if not 0 <= value < 1:
        raise LionCubConfigError(f"LionCub: beta2 {text!r} must be in [0, 1), e.g. 0.95 or 0.99")
    return value


def non_negative_number(text: str) -> float:
    value = _as_float(text)
    if not (value >= 0 and value != float("inf")):
        raise LionCubConfigError(f"LionCub: {text!r} must be a number >= 0")
    return value


def positive_number(text: str) -> float:
    value = _as_float(text)
    if not (value > 0 and value != float("inf")):
        raise LionCubConfigError(f"LionCub: {text!r} must be a positive number")
    return value


def samples(text: str) -> float:
    """A number of samples > 0 (a batch or a noise scale), written as a number such as 4096 or 1e6."""
    value = _as_float(text, " (write samples, e.g. 4096 or 1e6)")
    if not (value > 0 and math.isfinite(value)):
        raise LionCubConfigError(f"LionCub: {text!r} must be a positive number of samples")
    return value


__all__ = [
    "MAX_NODES",
    "MAX_PARAMS",
    "MAX_RANKS_PER_NODE",
    "MAX_THREADS",
    "ZERO_STAGES",
    "argument",
    "beta",
    "fraction",
    "nodes_count",
    "non_negative_number",
    "params_count",
    "positive_number",
    "ranks_count",
    "samples",
    "threads_count",
]
