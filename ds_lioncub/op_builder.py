"""The packing op builders, kept importable under their first home.

They live in :mod:`ds_lioncub.comm.packing.builders`, next to the packing code that loads them; this
module re-exports them (and the package logger) so ``from ds_lioncub.op_builder import
LionCubPackingCPUBuilder`` keeps working.
"""

from __future__ import annotations

from ds_lioncub._logging import get_logger
from ds_lioncub.comm.packing.builders import (
    BUILD_VAR,
    PACKAGE_DIR,
    REPO_DIR,
    LionCubPackingCPUBuilder,
    LionCubPackingCUDABuilder,
    builders,
    default_build_root,
    ops_dir,
)

__all__ = [
    "BUILD_VAR",
    "PACKAGE_DIR",
    "REPO_DIR",
    "LionCubPackingCPUBuilder",
    "LionCubPackingCUDABuilder",
    "builders",
    "default_build_root",
    "get_logger",
    "ops_dir",
]
