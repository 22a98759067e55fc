"""JIT builds of the packing ops in immutable directories, one per build key.

torch's own JIT cache (``torch.utils.cpp_extension.load``) keeps one directory per op name and lets ninja
decide what to rebuild there. That cost us twice (measured on this project's machines):

- the ninja found on PATH decided: Debian's ninja 1.11 and the venv's 1.13 each read the other's build
  log as stale, so running with and without the venv's ``bin`` on PATH rebuilt the op every time (15 to
  25 s on 2 cores);
- a rebuild relinks the library in place (GNU ld truncates and rewrites the same inode), under any
  process that has it mapped.

Here a build key names the directory ``<root>/<op>-<key>``. The key hashes what decides the library's
bytes: the sources and headers (their contents), the compiler's flags, the compiler itself (its path and
``--version``), torch, the Python ABI and, for ``-march=native`` builds, the CPU's feature flags. Not PATH,
not the ninja that runs the build, not file times. A build runs in a private staging directory and is
renamed into place when complete; a keyed directory is never written again, so a process never sees a
library change under it. Loading a keyed build imports its library directly, without ninja.

The ranks of a job load at the same moment: they take an exclusive ``flock`` on ``<root>/<op>-<key>.lock``;
the first builds, the others wait and import its result. The kernel drops the lock when its holder
exits, so a build that crashed or was killed never blocks the next one (its staging directory is removed
by the next holder of the lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

KEY_LENGTH = 16  # hex digits of the sha256: 64 bits, for the handful of builds one cache holds
STAGING_PREFIX = ".staging-"


def compiler_identity(compiler: str) -> str:
    """The C++ compiler torch's JIT runs (``CXX``, else ``c++``): its resolved path and ``--version``."""
    resolved = shutil.which(compiler)
    if resolved is None:
        return f"{compiler}: not found"
    try:
        version = subprocess.run([resolved, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        version = f"--version failed: {error}"
    return f"{os.path.realpath(resolved)}\n{version.strip()}"


def cpu_features() -> str:
    """What ``-march=native`` compiles for: the first CPU's feature flags (Linux), else the processor name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "isa")):  # x86, aarch64, riscv
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build_key(sources: Sequence[Path], parts: Sequence[str]) -> str:
    """The key of a build from ``sources`` (files whose bytes go into it) and ``parts`` (flags, tools, versions)."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (
        *parts,
        f"torch {torch.__version__} {torch.version.git_version} cuda {torch.version.cuda}",
        f"python {sys.implementation.cache_tag} {importlib.machinery.EXTENSION_SUFFIXES[0]}",
        platform.machine(),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:KEY_LENGTH]


def keyed_dir(root: Path, name: str, key: str) -> Path:
    return root / f"{name}-{key}"


def library_in(directory: Path, name: str) -> Path | None:
    """The op's library in a keyed build directory, if it is complete (renamed into place)."""
    if not directory.is_dir():
        return None
    # torch names a second build of the same op within one process <name>_v1, ...: one library per directory.
    found = sorted(directory.glob(f"{name}*{importlib.machinery.EXTENSION_SUFFIXES[-1]}"))
    return found[0] if found else None


def import_library(library: Path) -> ModuleType:
    """Import an op's compiled library as the module its file names (``lioncub_packing_cpu.so`` ->
    ``lioncub_packing_cpu``), as torch's JIT loader does, but without asking ninja first."""
    module_name = library.name.split(".", 1)[0]
    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def build_lock(root: Path, name: str, key: str) -> Iterator[None]:
    """Exclusive over every process that loads the same build (``flock``: released when its holder exits)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}-{key}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_build(
    root: Path,
    name: str,
    key: str,
    build_into: Callable[[Path], ModuleType],
    on_build: Callable[[Path], None] | None = None,
) -> tuple[ModuleType, bool]:
    """The op from ``<root>/<name>-<key>``, building it there first if it is not complete: (module, built).

    ``build_into(staging_root)`` must build the op under ``staging_root/<name>`` and return the module it
    imported from there; ``on_build(final_dir)`` is called before a build starts (to announce it).
    """
    final = keyed_dir(root, name, key)
    library = library_in(final, name)
    if library is not None:
        return import_library(library), False
    with build_lock(root, name, key):
        library = library_in(final, name)  # another process built it while this one waited
        if library is not None:
            return import_library(library), False
        for stale in root.glob(f"{STAGING_PREFIX}{name}-{key}-*"):  # left by a build that died holding the lock
            shutil.rmtree(stale, ignore_errors=True)
        if on_build is not None:
            on_build(final)
        staging = root / f"{STAGING_PREFIX}{name}-{key}-{os.getpid()}"
        staging.mkdir(parents=True)
        try:
            module = build_into(staging)
            built = staging / name
            if library_in(built, name) is None:
                raise RuntimeError(f"the JIT build of {name} left no library in {built}")
            if final.exists():  # an incomplete directory (no library): never loaded, safe to replace
                shutil.rmtree(final)
            os.rename(built, final)  # atomic: readers see no directory or a complete one
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    # The module was imported from the staging directory, which is gone: name the file where it now is.
    imported_from = getattr(module, "__file__", None)
    if imported_from is not None:
        module.__file__ = str(final / Path(imported_from).name)
        if module.__spec__ is not None:
            module.__spec__.origin = module.__file__
    return module, True


__all__ = [
    "build_key",
    "build_lock",
    "compiler_identity",
    "cpu_features",
    "import_library",
    "keyed_dir",
    "library_in",
    "load_or_build",
]
