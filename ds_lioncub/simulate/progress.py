"""Progress of ``python -m ds_lioncub.simulate``: one bar over every optimizer step of every run, on stderr.

A 300-step run at 64 workers takes minutes; the bar shows which run is training, its training loss and
the time left for the whole comparison. The per-run result lines go to stdout through the bar (so a
terminal shows both without tearing), and the table stays on stdout alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information


class Progress:
    """A tqdm bar of ``total_steps`` optimizer steps; ``enabled=False`` shows nothing but the result lines."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        # Where stderr is a log file, not a terminal, update it rarely: every refresh adds to the file.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        self._bar = tqdm(
            total=total_steps, unit="step", file=sys.stderr, disable=not enabled, mininterval=interval, leave=False
        )

    def start_run(self, label: str) -> Callable[[int, float], None]:
        """Name the run about to train; returns its per-step callback ``(step, training loss)``."""
        self._bar.set_description(label, refresh=False)

        def on_step(step: int, loss: float) -> None:
            self._bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            self._bar.update(1)

        return on_step

    def write(self, line: str) -> None:
        """Print ``line`` on stdout without tearing the bar."""
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self._bar.close()
