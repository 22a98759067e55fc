"""LionCub as a DeepSpeed optimizer: ``"optimizer": {"type": "LionCub", "params": {...}}``.

The only part of ds_lioncub that touches DeepSpeed's engine. :func:`register` (run by
``import ds_lioncub``) makes the name known to DeepSpeed and wraps engine methods
(:mod:`.engine_hooks`); each wrapper does nothing unless the engine's optimizer is a LionCub.
Who communicates under each mode, and what is refused, is :mod:`.wiring`; the per-rank momentum
files beside DeepSpeed's checkpoints are :mod:`.checkpoint`.
"""

from __future__ import annotations

from ds_lioncub.integration.checkpoint import momentum_state
from ds_lioncub.integration.engine_hooks import OPTIMIZER_NAME, find_lioncub, register
from ds_lioncub.integration.wiring import wire_engine

__all__ = ["OPTIMIZER_NAME", "find_lioncub", "momentum_state", "register", "wire_engine"]
