"""Import DeepSpeed with what it prints while importing on stderr, and its logs after that where it sends them.

``import deepspeed`` detects the accelerator and, where ``DS_ACCELERATOR`` is unset and no GPU is found, logs
"Setting accelerator to CPU" through DeepSpeed's logger, whose handler writes to stdout. A tool whose stdout is
its output (``python -m ds_lioncub.planner --json``) would print that line before its JSON. So the first import
of DeepSpeed made by ds_lioncub runs with stdout on stderr, and every logging handler DeepSpeed created during
it is pointed back at the stdout it would have had: DeepSpeed's logs while training go where DeepSpeed sends
them, only its import-time messages move to stderr. Where DeepSpeed was imported before ds_lioncub, nothing
changes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys


class _ToStderr(io.TextIOBase):
    """A stand-in stdout that writes to the stderr of the moment (so it is recognised afterwards by identity)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def import_deepspeed() -> None:
    """``import deepspeed`` with its import-time output on stderr (once; nothing if it is already imported)."""
    if "deepspeed" in sys.modules:
        return
    stdout = sys.stdout
    stand_in = _ToStderr()
    try:
        with contextlib.redirect_stdout(stand_in):
            import deepspeed  # noqa: F401
    finally:
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for logger in loggers:
            for handler in getattr(logger, "handlers", ()):
                if isinstance(handler, logging.StreamHandler) and handler.stream is stand_in:
                    handler.setStream(stdout)


import_deepspeed()  # on ``import ds_lioncub``, before any module of it imports DeepSpeed

__all__ = ["import_deepspeed"]
