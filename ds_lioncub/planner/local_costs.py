"""What a step costs on the rank itself, per element: Lion's arithmetic and each aggregation's local work.

A :class:`LocalCosts` table holds seconds per element for

- ``"lion_update"``: Lion's own arithmetic on one stepped element (the pre-sign update, the momentum
  and the parameter update), the same in every mode but applied to ``N`` elements at ZeRO stage 0
  and to a rank's shard under ZeRO;
- one key per aggregation (:func:`aggregation_key`): everything the aggregation of one element
  does on the rank besides moving bytes: converting, packing, the owner's vote or field sums, the
  float sums of an all-reduce, unpacking.

``python -m ds_lioncub.planner --calibrate`` measures a table on this machine
(:mod:`ds_lioncub.planner.calibrate`); :data:`DEFAULT_LOCAL_COSTS` is the table measured on the
machine the repository is developed on (``ds_lioncub/planner/default_local_costs.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_lioncub.config import LionCubConfig
from ds_lioncub.errors import LionCubConfigError
from ds_lioncub.modes import mode_of
from ds_lioncub.planner import default_local_costs

LION_UPDATE = "lion_update"


def aggregation_key(options: LionCubConfig) -> str:
    """The table key of an aggregation: ``"none/fp32"``, ``"1bit"``, ``"kbit/l1/8/alltoall/vote"``, ... (its mode's
    record names it)."""
    return mode_of(options).local_cost_key(options)


@dataclass(frozen=True)
class LocalCosts:
    """Seconds per element of local work, by :func:`aggregation_key` (and ``"lion_update"``).

    Attributes:
        seconds_per_element: the table.
        measured_on: where and how it was measured (machine, packing path, element count), or derived.
        extra: other fields of a saved table, kept as they were.
        device: the ranks' device it describes, "cpu" or "cuda" (a saved table without one is a CPU's).
    """

    seconds_per_element: Mapping[str, float]
    measured_on: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    device: str = "cpu"

    def cost(self, key: str) -> float:
        """Seconds per element for ``key``; a table without it raises, naming the fix."""
        try:
            return float(self.seconds_per_element[key])
        except KeyError:
            known = ", ".join(sorted(self.seconds_per_element))
            raise LionCubConfigError(
                f"LionCub: the local cost table has no entry {key!r} (it has {known}). "
                f"Measure a complete table with python -m ds_lioncub.planner --calibrate."
            ) from None

    def to_json(self) -> str:
        return json.dumps(
            {
                "measured_on": self.measured_on,
                "device": self.device,
                "seconds_per_element": dict(self.seconds_per_element),
                **self.extra,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def load(cls, path: str | Path) -> LocalCosts:
        """A table saved by ``--calibrate --save PATH``."""
        data = json.loads(Path(path).read_text())
        table = data.get("seconds_per_element")
        if not isinstance(table, dict) or not all(isinstance(v, int | float) and v >= 0 for v in table.values()):
            raise LionCubConfigError(
                f"LionCub: {path} is not a local cost table (it needs a 'seconds_per_element' object of "
                f"non-negative numbers); write one with python -m ds_lioncub.planner --calibrate --save {path}."
            )
        device = data.get("device", "cpu")
        if device not in ("cpu", "cuda"):
            raise LionCubConfigError(
                f"LionCub: {path} says its device is {device!r}; a local cost table is a 'cpu' or a 'cuda' one."
            )
        fields = ("seconds_per_element", "measured_on", "device")
        extra = {key: value for key, value in data.items() if key not in fields}
        return cls(table, str(data.get("measured_on", "")), extra, device)


DEFAULT_LOCAL_COSTS = LocalCosts(default_local_costs.SECONDS_PER_ELEMENT, default_local_costs.MEASURED_ON)

__all__ = ["DEFAULT_LOCAL_COSTS", "LION_UPDATE", "LocalCosts", "aggregation_key"]
