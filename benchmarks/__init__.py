"""Benchmarks for ds_lioncub. Run them as modules from the repository root, e.g. ``python -m benchmarks.bench_comm``.

Processes a benchmark starts by path (its ranks, a measurement subprocess) get :func:`repo_environment`, so
they import this checkout's ``ds_lioncub``, ``benchmarks`` and ``examples`` whatever their working directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the repository root first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    rest = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *rest])
    return env
