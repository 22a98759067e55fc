"""A real JIT build of the CPU packing op beside whatever else runs: the same op with one more macro.

    python -m tests.support.jit_variant VALUE [--remove]

The macro ``LIONCUB_JIT_VARIANT=VALUE`` is read by no source; it only makes another build key, so each new
VALUE builds the op again into the same cache directory (tests/kernels/test_jit_cache.py,
benchmarks/stress_rank_exit.py). Prints how the op was loaded and its build directory; ``--remove`` then
deletes that directory and its lock file (no other process loads a variant).
"""

from __future__ import annotations

import argparse
import shutil
import sys

from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder


class VariantBuilder(LionCubPackingCPUBuilder):
    """The CPU packing op with ``-DLIONCUB_JIT_VARIANT=<value>`` added to its flags."""

    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), f"-DLIONCUB_JIT_VARIANT={self.value}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("value", help="the macro's value: a new one builds the op again")
    parser.add_argument("--remove", action="store_true", help="delete the build and its lock file afterwards")
    args = parser.parse_args(argv)
    builder = VariantBuilder(args.value)
    builder.load()
    build_dir = builder.jit_build_dir()
    print(builder.load_source)
    print(build_dir, flush=True)
    if args.remove:
        shutil.rmtree(build_dir)
        build_dir.with_name(f"{build_dir.name}.lock").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
