"""The compression modes, one record each (:class:`ModeRecord`), and the registry the rest of LionCub asks.

Every question that depends on the mode (which options apply, how its aggregation is built, what its wire
carries, what the planner prices, how the convergence study names its cells) is answered by the mode's
record, found by :func:`mode_of` (the options) or :func:`mode_named` (a ``compression`` value), instead of by
a branch on ``compression`` at the call site.

One module per mode: :mod:`~ds_lioncub.modes.exact` (``"none"``), :mod:`~ds_lioncub.modes.one_bit`
(``"1bit"``), :mod:`~ds_lioncub.modes.kbit` (``"kbit"``), :mod:`~ds_lioncub.modes.auto` (``"auto"``, which the
planner resolves). A new mode is a new module declaring its record and one entry in :data:`REGISTERED`; the
option ``compression`` accepts the registered names, in this order (docs/user-guide.md, "Adding a mode").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes.auto import AUTO
from ds_lioncub.modes.exact import EXACT
from ds_lioncub.modes.kbit import KBIT
from ds_lioncub.modes.one_bit import ONE_BIT
from ds_lioncub.modes.record import ModeOptions, ModeRecord, ModeRefusal

#: Every mode, in the order option ``compression`` lists them.
REGISTERED: tuple[ModeRecord, ...] = (EXACT, ONE_BIT, KBIT, AUTO)

#: The records by the ``compression`` value they answer to.
MODES: Mapping[str, ModeRecord] = MappingProxyType({record.name: record for record in REGISTERED})
#: The values option ``compression`` accepts.
MODE_NAMES: tuple[str, ...] = tuple(MODES)


def mode_named(name: str) -> ModeRecord:
    """The record of the mode ``compression=name``; refuses a name no mode answers to."""
    try:
        return MODES[name]
    except KeyError:
        known = ", ".join(repr(known) for known in MODE_NAMES)
        raise LionCubConfigError(f"LionCub: no compression mode is named {name!r} (the modes: {known}).") from None


def mode_of(options: ModeOptions) -> ModeRecord:
    """The record of the mode ``options`` ask for (their ``compression``)."""
    return mode_named(options.compression)


__all__ = ["MODES", "MODE_NAMES", "REGISTERED", "ModeOptions", "ModeRecord", "ModeRefusal", "mode_named", "mode_of"]
