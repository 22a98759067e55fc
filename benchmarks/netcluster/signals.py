"""Turning SIGINT / SIGTERM / SIGHUP into exceptions, so that ``with`` blocks tear down on Ctrl-C or kill.

Python already raises KeyboardInterrupt on SIGINT; SIGTERM and SIGHUP would end the process without
running any ``finally``. Inside :func:`signals_as_exceptions` all three raise :class:`Interrupted`.
:func:`shielded` holds them off while teardown runs, so a second Ctrl-C cannot leave namespaces
behind; the first one is delivered again once the shielded block ends.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Interrupted(KeyboardInterrupt):
    """A handled signal arrived; ``signum`` says which (exit status 128 + signum by convention)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _handlers(handler: _Handler) -> Iterator[None]:
    if not _in_main_thread():  # signal handlers can only be installed from the main thread
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in HANDLED}
    for signum in HANDLED:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` inside the block."""
    with _handlers(_raise):
        yield


@contextmanager
def shielded(message: str = "netcluster: tearing down, please wait") -> Iterator[None]:
    """Defer SIGINT / SIGTERM / SIGHUP during the block; the first one deferred is raised after it."""
    pending: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        if not pending:
            print(message, file=sys.stderr, flush=True)
        pending.append(signum)

    with _handlers(note):
        yield
    if pending:
        signal.raise_signal(pending[0])  # now handled as it would have been without the shield
