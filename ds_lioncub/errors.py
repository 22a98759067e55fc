"""The errors ds_lioncub raises for things a user can fix.

Every message starts with :data:`MESSAGE_PREFIX` and names the option or value, the limit, and the fix.
Errors raised before training are raised identically on every rank (the checks run on values every
rank shares), so a bad job stops everywhere with the same message instead of hanging.

- :class:`LionCubError` — the base of everything below.
- :class:`LionCubConfigError` — an option, a value or a combination that cannot work (also a
  ``ValueError``); :class:`UnsupportedParameterError` is the case of a parameter LionCub cannot
  optimize (also a ``TypeError``).
- :class:`LionCubSetupError` — the job, the environment or saved state cannot serve a valid config:
  how MPI was launched, a kernel that cannot load, a checkpoint that does not match (also a
  ``RuntimeError``); :class:`MpiSetupError` is its MPI case.
- :class:`MissingDependencyError` — an optional dependency is not installed (also an ``ImportError``).
- :class:`NonFiniteGradientError` — a rank had a NaN/inf gradient and the step was refused on every
  rank (also a ``FloatingPointError``).

Internal preconditions of low-level helpers (buffer sizes in the packing functions) stay plain
``ValueError``s: they signal a bug in the caller, not a user mistake.
"""

from __future__ import annotations

MESSAGE_PREFIX = "LionCub: "


class LionCubError(Exception):
    """Base of ds_lioncub's user-facing errors; the message always starts with ``"LionCub: "``."""

    def __init__(self, message: str) -> None:
        if not message.startswith(MESSAGE_PREFIX):
            message = MESSAGE_PREFIX + message
        super().__init__(message)


class LionCubConfigError(LionCubError, ValueError):
    """An option has an unknown name, a bad value, or conflicts with another option or the world size."""


class UnsupportedParameterError(LionCubConfigError, TypeError):
    """A parameter (or its gradient) has a dtype or layout LionCub cannot optimize."""


class LionCubSetupError(LionCubError, RuntimeError):
    """The job, the environment or saved state cannot serve this (valid) configuration."""


class MpiSetupError(LionCubSetupError):
    """The MPI job cannot serve this data-parallel group (how it was launched, rank layout, CUDA support)."""


class MissingDependencyError(LionCubError, ImportError):
    """An optional dependency that the requested option needs cannot be imported."""


class NonFiniteGradientError(LionCubError, FloatingPointError):
    """Some rank had a NaN/inf gradient; the step was applied on no rank."""


__all__ = [
    "MESSAGE_PREFIX",
    "LionCubConfigError",
    "LionCubError",
    "LionCubSetupError",
    "MissingDependencyError",
    "MpiSetupError",
    "NonFiniteGradientError",
    "UnsupportedParameterError",
]
