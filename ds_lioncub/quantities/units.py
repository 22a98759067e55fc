"""The network quantities users type (the planner's command line, the ``network`` option): rates, latencies.

Rates: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (tc(8)'s spelling, as benchmarks/netcluster takes them)
are bits per second with decimal prefixes, also written ``Gbit/s`` as :func:`format_rate` prints them;
``B/s``, ``kB/s``, ``MB/s``, ``GB/s``, ``TB/s`` are bytes per second. ``mbps`` and its kin are refused:
tc reads them as bytes per second and most people as bits, an 8x difference nobody should have to guess.
Durations take ``s``, ``ms``, ``us`` (``µs``) or ``ns``. Both return plain floats in SI units: bytes per
second and seconds.
"""

from __future__ import annotations

import math
import re

from ds_lioncub.errors import LionCubConfigError

_NUMBER = r"(?P<value>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "µs": 1e-6, "usec": 1e-6, "ns": 1e-9}
RATE_EXAMPLES = "'1gbit', '400gbit', '250mbit', '1 Gbit/s' (bits/s) or '10GB/s' (bytes/s)"


def _split(text: str, what: str, examples: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*(?P<unit>[A-Za-zµ/]*)", str(text).strip())
    if match is None:
        raise LionCubConfigError(f"LionCub: cannot read {what} {text!r}; write it like {examples}.")
    return float(match["value"]), match["unit"]


def _finite(value: float, text: str, what: str, examples: str) -> float:
    # "1e400gbit" reads as inf: refused here, naming what was typed, rather than later as "inf" (where a latency
    # of inf was reported as "must be >= 0").
    if not math.isfinite(value):
        raise LionCubConfigError(
            f"LionCub: {what} {text!r} is too large to be a number (it reads as infinity); write it like {examples}."
        )
    return value


def parse_rate(text: str) -> float:
    """Bytes per second of a rate such as ``"1gbit"`` (1.25e8), ``"400gbit"``, ``"250mbit"`` or ``"10GB/s"``."""
    value, unit = _split(text, "the rate", RATE_EXAMPLES)
    lower = unit.lower().removesuffix("/s") if unit.lower().endswith("bit/s") else unit.lower()
    if lower.endswith("bit"):
        prefix, bytes_per_unit = lower[:-3], 1 / 8
    elif lower.endswith("bps"):
        raise LionCubConfigError(
            f"LionCub: the rate {text!r} is ambiguous: tc reads '{unit}' as bytes per second, most people as bits. "
            f"Write bits as '{value:g}{lower[:-3]}bit' or bytes as '{value:g}{lower[:-3].upper()}B/s'."
        )
    elif unit.endswith("B/s"):
        prefix, bytes_per_unit = lower[:-3], 1.0
    else:
        raise LionCubConfigError(f"LionCub: the rate {text!r} has no unit I know; write it like {RATE_EXAMPLES}.")
    if prefix not in _PREFIX:
        raise LionCubConfigError(f"LionCub: the rate {text!r} has an unknown prefix {prefix!r}; use k, m, g or t.")
    rate = _finite(value * _PREFIX[prefix] * bytes_per_unit, text, "the rate", RATE_EXAMPLES)
    if rate <= 0:
        raise LionCubConfigError(f"LionCub: a rate must be positive, got {text!r}.")
    return rate


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``"5us"``, ``"50us"``, ``"1ms"`` or ``"0s"``."""
    value, unit = _split(text, "the duration", "'5us', '50us' or '1ms'")
    factor = _SECONDS.get(unit.lower())
    if factor is None:
        raise LionCubConfigError(f"LionCub: the duration {text!r} needs a unit: s, ms, us or ns (e.g. '50us').")
    return _finite(value * factor, text, "the duration", "'5us', '50us' or '1ms'")


def format_rate(bytes_per_second: float) -> str:
    """A rate as people say it, in bits per second: ``1.25e8`` -> ``"1 Gbit/s"``."""
    bits = bytes_per_second * 8
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits >= scale:
            return f"{bits / scale:.3g} {name}"
    return f"{bits:.3g} bit/s"


def format_seconds(seconds: float) -> str:
    """``0.041`` -> ``"41 ms"``, ``1.3`` -> ``"1.3 s"``, ``2.5e-5`` -> ``"25 us"`` (three significant digits)."""
    for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {name}"
    return f"{seconds * 1e9:.3g} ns"


__all__ = ["format_rate", "format_seconds", "parse_duration", "parse_rate"]
