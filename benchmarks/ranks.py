"""Run a benchmark module as the ranks of one gloo job: the module again, once per rank, with ``--rank R --store S``.

A benchmark that times collectives on real ranks parses ``--rank`` and ``--store`` (hidden; :func:`add_rank_options`)
beside its own options; without ``--rank`` it is the launcher and calls :func:`run_module_ranks`, with it a rank
that joins ``file://S``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """The hidden options :func:`run_module_ranks` gives each rank: ``--rank R`` and ``--store S``."""
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)


def run_module_ranks(module: str, world_size: int, argv: Sequence[str]) -> list[int]:
    """``python -m module *argv --store S --rank R`` for R in 0..world_size-1 at once, S a fresh file-store path;
    each rank's exit code once all have ended."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as work:
        command = [sys.executable, "-m", module, *argv, "--store", str(Path(work) / "store")]
        procs = [subprocess.Popen([*command, "--rank", str(rank)]) for rank in range(world_size)]
        return [proc.wait() for proc in procs]


__all__ = ["add_rank_options", "run_module_ranks"]
