"""Tests marked ``netns`` build real network namespaces: they need root and ``ip netns``, and are skipped with
the reason where this machine cannot (``python -m benchmarks.netcluster --check`` says why)."""

from __future__ import annotations

import pytest

from benchmarks.netcluster import unavailable_reason


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is not None:
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(f"netcluster cannot run here: {reason}")
