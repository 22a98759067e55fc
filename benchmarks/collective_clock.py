"""Seconds spent inside collectives, by wrapping the functions that issue them.

The benchmarks split a call or a training step into the time inside collectives and the rest (local
compute: packing, counting, the optimizer's arithmetic). ``time(f)`` returns a timed ``f``;
``wrap(owner, name)`` replaces ``owner.name`` with its timed version until ``restore()``. Only the
benchmark's own objects (or module attributes, for the duration of a run) are wrapped; the library
is not changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class CollectiveClock:
    def __init__(self) -> None:
        self.seconds = 0.0
        self._restore: list[Callable[[], None]] = []

    def time(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, self.time(original))
        self._restore.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        while self._restore:
            self._restore.pop()()
