"""LionCub's options: one validated model, its blocks, the rules across options, and their reference.

- :mod:`~ds_lioncub.config.options`: :class:`LionCubConfig`, every top-level option with a docstring, and
  :func:`parse_config`, the one entry both ``LionCub(**options)`` and the ds_config go through;
- :mod:`~ds_lioncub.config.sections`: the nested blocks (``momentum_sync``, ``consistency_check``,
  ``telemetry``, ``error_feedback``, ``clip``, ``hybrid``, ``network``);
- :mod:`~ds_lioncub.config.rules`: the combinations of options that cannot work together, one table (and the
  message for an option the ZeRO hybrid refuses);
- :mod:`~ds_lioncub.config.clip_rule`: which clipping runs, option ``clip`` against DeepSpeed's ``gradient_clipping``;
- :mod:`~ds_lioncub.config.strict_types`: the strict reals, integers, flags, rates and durations;
- :mod:`~ds_lioncub.config.reference`: docs/options.md rendered from the models.

A new option goes in ``options.py`` (or its block in ``sections.py``), with its rule, if it depends on
another option, in ``rules.py``.
"""

from __future__ import annotations

from ds_lioncub.config.options import LionCubConfig, parse_config
from ds_lioncub.config.rules import CROSS_OPTION_RULES, CrossOptionRule
from ds_lioncub.config.sections import (
    ClipConfig,
    CommDtype,
    ConsistencyCheckConfig,
    ErrorFeedbackConfig,
    HybridConfig,
    JobConfig,
    MomentumSyncConfig,
    NetworkConfig,
    TelemetryConfig,
)

__all__ = [
    "CROSS_OPTION_RULES",
    "ClipConfig",
    "CommDtype",
    "ConsistencyCheckConfig",
    "CrossOptionRule",
    "ErrorFeedbackConfig",
    "HybridConfig",
    "LionCubConfig",
    "MomentumSyncConfig",
    "JobConfig",
    "NetworkConfig",
    "TelemetryConfig",
    "parse_config",
]
