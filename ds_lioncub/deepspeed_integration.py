"""Deprecated: the DeepSpeed integration moved to :mod:`ds_lioncub.integration` (kept for one release)."""

from __future__ import annotations

from ds_lioncub.integration import OPTIMIZER_NAME, find_lioncub, register, wire_engine
from ds_lioncub.integration.checkpoint import momentum_state

__all__ = ["OPTIMIZER_NAME", "find_lioncub", "momentum_state", "register", "wire_engine"]
