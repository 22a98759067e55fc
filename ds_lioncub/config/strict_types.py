"""The strict types of LionCub's options (:mod:`ds_lioncub.config`).

Left to itself pydantic reads true as 1, false as 0 and "10" as 10 ("lr": true trained at lr 1.0), and
"0"/"no"/1 as booleans. Every option takes its own type only, in the ds_config and in LionCub(...) alike:
booleans are not numbers, strings are not numbers, numbers and strings are not booleans. A JSON integer where
a real is expected ("weight_decay": 0) and a whole real where an integer is expected ("bucket_size": 5e8, how
DeepSpeed configs write sizes) stay valid: they are the same number. network's rates and durations are the one
place strings are numbers, because they carry units ("1gbit", "50us"; :class:`~ds_lioncub.config.NetworkConfig`).

:mod:`ds_lioncub.config.reference` names each type in docs/options.md by the validator it carries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.quantities.units import parse_duration, parse_rate


def only_numbers(value: Any) -> Any:
    """A number (or None, for the optional ones) passes on to the field's own checks; a boolean or a string does not."""
    if isinstance(value, bool):
        raise ValueError("booleans are not numbers (true would be read as 1); write the number itself")
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            raise ValueError("must be a number, written without quotes (strings are not numbers)") from None
        raise ValueError(f"strings are not numbers; write {value.strip()} without quotes")
    return value


def only_booleans(value: Any) -> Any:
    """true or false pass; a number or a string does not."""
    if not isinstance(value, bool):
        raise ValueError("must be true or false (True or False in Python); numbers and strings are not booleans")
    return value


def _quantity(value: Any, parse: Callable[[str], float], unit: str) -> Any:
    """A string through ``parse`` (its error without "LionCub: ", which parse_config adds); a number as it is."""
    if isinstance(value, str):
        try:
            return parse(value)
        except LionCubConfigError as error:
            raise ValueError(str(error).removeprefix("LionCub: ").rstrip(".")) from None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"must be a string such as {unit} or a number")


def rate(value: Any) -> Any:
    """A rate with units ("1gbit", "10GB/s") to bytes per second; a number is bytes per second already."""
    return None if value is None else _quantity(value, parse_rate, "'1gbit'")


def duration(value: Any) -> Any:
    """A duration with units ("50us", "1ms") to seconds; a number is seconds already."""
    return _quantity(value, parse_duration, "'50us'")


Real = Annotated[float, BeforeValidator(only_numbers)]
"""A real number: an int or a float, never a bool or a string."""

OptionalReal = Annotated[float | None, BeforeValidator(only_numbers)]
"""A real number or None (the validator wraps the whole union, so an error names the option, not a union branch)."""

Whole = Annotated[int, BeforeValidator(only_numbers)]
"""An integer: an int or a whole float (5e8), never a bool or a string."""

OptionalWhole = Annotated[int | None, BeforeValidator(only_numbers)]
"""An integer or None."""

Flag = Annotated[bool, BeforeValidator(only_booleans)]
"""true or false, nothing else."""

Rate = Annotated[float, BeforeValidator(rate)]
"""Bytes per second, from a rate with units or a number."""

OptionalRate = Annotated[float | None, BeforeValidator(rate)]
"""A rate or None."""

Duration = Annotated[float, BeforeValidator(duration)]
"""Seconds, from a duration with units or a number."""
