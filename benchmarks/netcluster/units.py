"""Parsing the quantities users type: link rates (tc syntax) and durations.

Rates follow tc(8): ``bit``/``kbit``/``mbit``/``gbit``/``tbit`` are bits per second with decimal
prefixes (``kibit``, ``mibit``, ... binary), ``bps``/``kbps``/``mbps``/``gbps``/``tbps`` are *bytes*
per second. A bare number is bits per second. Durations accept ``s``, ``ms``, ``us`` (or ``usec``,
``msec``, ``sec``); a bare number is seconds.
"""

from __future__ import annotations

import re

_NUMBER = r"(?P<value>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?"
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_TIME_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
}


def _split(text: str, what: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*(?P<unit>[A-Za-z]*)", text.strip())
    if match is None:
        raise ValueError(f"cannot parse {what} {text!r}")
    value = float(match["value"]) * (10 ** int(match["exp"]) if match["exp"] else 1)
    return value, match["unit"].lower()


def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate, e.g. ``"1gbit"`` -> 1_000_000_000, ``"125mbps"`` -> 1e9."""
    value, unit = _split(text, "rate")
    if unit.endswith("bit"):
        prefix, scale = unit[:-3], 1
    elif unit.endswith("bps"):
        prefix, scale = unit[:-3], 8
    elif unit == "":
        prefix, scale = "", 1
    else:
        raise ValueError(f"cannot parse rate {text!r}: unit must end in 'bit' (bits/s) or 'bps' (bytes/s)")
    if prefix in _DECIMAL:
        multiplier = _DECIMAL[prefix]
    elif prefix in _BINARY:
        multiplier = _BINARY[prefix]
    else:
        raise ValueError(f"cannot parse rate {text!r}: unknown prefix {prefix!r}")
    bits_per_second = round(value * multiplier * scale)
    if bits_per_second <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return bits_per_second


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``"0.2ms"``, ``"200us"``, ``"1s"`` or ``"0"``."""
    value, unit = _split(text, "duration")
    if unit not in _TIME_UNITS:
        raise ValueError(f"cannot parse duration {text!r}: unit must be s, ms or us")
    return value * _TIME_UNITS[unit]


def parse_count(text: str) -> int:
    """An element count such as ``"1e8"``, ``"100000000"`` or ``"10M"`` (decimal suffixes k, M, G)."""
    value, unit = _split(text, "count")
    multiplier = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}.get(unit)
    if multiplier is None:
        raise ValueError(f"cannot parse count {text!r}: suffix must be k, M or G")
    count = value * multiplier
    if count != int(count) or count < 1:
        raise ValueError(f"count must be a positive integer, got {text!r}")
    return int(count)


def format_rate(bits_per_second: float) -> str:
    """Short human form, e.g. 1e9 -> ``"1 Gbit/s"``."""
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g} {name}"
    return f"{bits_per_second:g} bit/s"


def format_bytes(count: float) -> str:
    """Decimal units (MB = 1e6 bytes), matching how link rates are quoted."""
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {name}" if abs(count) < 100 * scale else f"{count / scale:.0f} {name}"
    return f"{count:.0f} B"
