"""The JIT cache of the packing ops (ds_lioncub/kernels/jit_cache.py): one immutable directory per build
key, a key that does not follow PATH, one build for concurrent loads, and a build beside a running job that
leaves the job's library and results alone.

The in-process tests stand in for the compiler with a copy of the op this session built (``cpu_op``): what they
check is where files go, who builds and when, not the compiler. The two multi-process tests use the real build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder
from ds_lioncub.kernels.jit_cache import STAGING_PREFIX, build_key, library_in, load_or_build
from tests.support import checks
from tests.support.launch import REPO, run_ranks, worker_environment

NAME = "lioncub_packing_cpu"
VENV_BIN = str(Path(sys.executable).parent)


def path_without_venv() -> str:
    return os.pathsep.join(part for part in os.environ.get("PATH", "").split(os.pathsep) if part != VENV_BIN)


def path_with_venv_first() -> str:
    return os.pathsep.join([VENV_BIN, path_without_venv()])


def copy_build(cpu_op: Any, calls: list[Path]) -> Callable[[Path], Any]:
    """A stand-in for the compiler: puts this session's library where torch's JIT would build it, and returns
    a module named from there, as torch's import of it would be."""
    library = Path(cpu_op.__file__)
    assert library.exists(), f"the session's op names a file that is not there: {library}"

    def build_into(staging_root: Path) -> Any:
        calls.append(staging_root)
        (staging_root / NAME).mkdir(parents=True)
        copied = staging_root / NAME / library.name
        shutil.copy(library, copied)
        module = types.ModuleType(NAME)
        module.__file__ = str(copied)
        return module

    return build_into


def test_the_build_key_does_not_follow_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which ninja PATH finds (Debian's or the venv's) used to decide whether the op was rebuilt."""
    builder = LionCubPackingCPUBuilder()
    keys = {}
    for label, path in (("venv first", path_with_venv_first()), ("no venv", path_without_venv())):
        monkeypatch.setenv("PATH", path)
        keys[label] = build_key(builder.jit_key_files(), builder.jit_key_parts())
    assert keys["venv first"] == keys["no venv"], keys


def test_the_build_key_follows_the_sources_the_flags_and_the_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = LionCubPackingCPUBuilder()
    files, parts = builder.jit_key_files(), builder.jit_key_parts()
    reference = build_key(files, parts)
    assert builder.jit_key() == reference
    assert any(path.name == "lioncub_packing.cpp" for path in files)
    assert any(path.suffix == ".h" for path in files)
    # a source that differs by one byte
    edited = tmp_path / files[0].name
    edited.write_bytes(files[0].read_bytes() + b" ")
    assert build_key([edited, *files[1:]], parts) != reference
    # another flag
    flagged = LionCubPackingCPUBuilder()
    monkeypatch.setattr(flagged, "cxx_args", lambda: [*builder.cxx_args(), "-DLIONCUB_OTHER_FLAG"])
    assert build_key(files, flagged.jit_key_parts()) != reference
    # another compiler on CXX: a script that answers --version differently
    compiler = tmp_path / "other-c++"
    compiler.write_text("#!/bin/sh\necho 'other-c++ (a compiler) 99.0'\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    assert build_key(files, builder.jit_key_parts()) != reference


def test_a_build_lands_complete_in_its_keyed_directory_and_is_then_loaded_without_building(
    cpu_op: Any, tmp_path: Path
) -> None:
    calls: list[Path] = []
    announced: list[Path] = []
    module, built = load_or_build(tmp_path, NAME, "k1", copy_build(cpu_op, calls), announced.append)
    final = tmp_path / f"{NAME}-k1"
    assert built and announced == [final]
    assert library_in(final, NAME) is not None
    # imported from the staging directory, which is gone: the module names where its file is now
    assert Path(module.__file__) == library_in(final, NAME) and Path(module.__file__).exists(), module.__file__
    assert not list(tmp_path.glob(f"{STAGING_PREFIX}*")), "the staging directory is left behind"
    assert calls and calls[0].name.startswith(STAGING_PREFIX), calls  # built away from the final directory
    inode = library_in(final, NAME).stat().st_ino  # type: ignore[union-attr]

    module, built = load_or_build(tmp_path, NAME, "k1", copy_build(cpu_op, calls), announced.append)
    assert not built and len(calls) == 1 and module.simd() == cpu_op.simd()
    assert library_in(final, NAME).stat().st_ino == inode  # type: ignore[union-attr]
    # another key builds beside it and leaves it alone
    load_or_build(tmp_path, NAME, "k2", copy_build(cpu_op, calls))
    assert len(calls) == 2 and library_in(final, NAME).stat().st_ino == inode  # type: ignore[union-attr]


def test_a_failed_build_leaves_nothing_and_the_next_load_builds(cpu_op: Any, tmp_path: Path) -> None:
    def broken(staging_root: Path) -> Any:
        (staging_root / NAME).mkdir()
        (staging_root / NAME / "half-written.o").write_bytes(b"\0")
        raise RuntimeError("compiler crashed")

    # a build that died holding the lock (killed: its staging directory stayed)
    (tmp_path / f"{STAGING_PREFIX}{NAME}-k1-999999" / NAME).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        load_or_build(tmp_path, NAME, "k1", broken)
    assert not (tmp_path / f"{NAME}-k1").exists()
    assert not list(tmp_path.glob(f"{STAGING_PREFIX}*")), list(tmp_path.iterdir())
    calls: list[Path] = []
    _, built = load_or_build(tmp_path, NAME, "k1", copy_build(cpu_op, calls))
    assert built and len(calls) == 1


def test_concurrent_loads_build_once(cpu_op: Any, tmp_path: Path) -> None:
    """The second loader waits on the first's lock, then imports its build instead of building again."""
    first_building, release = threading.Event(), threading.Event()
    calls: list[Path] = []
    copy = copy_build(cpu_op, calls)

    def slow_build(staging_root: Path) -> Any:
        first_building.set()
        assert release.wait(30)
        return copy(staging_root)

    results: dict[str, tuple[Any, bool]] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", load_or_build(tmp_path, NAME, "k", slow_build)))
    first.start()
    assert first_building.wait(30)
    second = threading.Thread(target=lambda: results.setdefault("second", load_or_build(tmp_path, NAME, "k", copy)))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second load did not wait for the build in progress"
    release.set()
    first.join(30)
    second.join(30)
    assert results["first"][1] is True and results["second"][1] is False
    assert len(calls) == 1


LOAD_AND_SAY = (
    "from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder as B; b = B(); m = b.load(); "
    "print(b.load_source); print(m.simd())"
)


def load_in_subprocess(path: str, extra: dict[str, str] | None = None) -> str:
    env = {**worker_environment(), "PATH": path, **(extra or {})}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_SAY], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-2]


@pytest.mark.slow
def test_processes_that_alternate_path_load_the_one_build(cpu_op: Any) -> None:
    """With and without the venv's bin on PATH (Debian's ninja or the venv's), processes used to rebuild the
    op on each switch (15-25 s each); now every one loads this session's build, untouched."""
    final = LionCubPackingCPUBuilder().jit_build_dir()
    library = library_in(final, NAME)
    assert library is not None, f"this session's build is not in {final}"
    before = (library.stat().st_ino, library.stat().st_mtime_ns)
    entries = sorted(path.name for path in final.parent.iterdir())
    for path in (path_without_venv(), path_with_venv_first(), path_without_venv()):
        assert load_in_subprocess(path) == f"JIT cache {final}"
    assert (library.stat().st_ino, library.stat().st_mtime_ns) == before
    assert sorted(path.name for path in final.parent.iterdir()) == entries


@pytest.mark.distributed
def test_a_build_beside_a_running_job_leaves_the_job_and_its_library_alone(cpu_op: Any, tmp_path: Path) -> None:
    """A real build of the same op (another key: one more flag) and a load from a process with another PATH run
    while a 3-rank gloo job votes and trains with the compiled op (tests/workers/run_scenarios.py). The job's
    results match the brute-force references, and its library keeps its inode and its bytes."""
    final = LionCubPackingCPUBuilder().jit_build_dir()
    library = library_in(final, NAME)
    assert library is not None, f"this session's build is not in {final}"
    before = (library.stat().st_ino, library.read_bytes())
    variant = subprocess.Popen(
        [sys.executable, "-m", "tests.support.jit_variant", str(os.getpid()), "--remove"],  # a real build, its own key
        env={**worker_environment(), "PATH": path_without_venv()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        job = run_ranks(REPO / "tests" / "workers" / "run_scenarios.py", 3, tmp_path / "job", timeout_s=600)
        assert load_in_subprocess(path_without_venv()) == f"JIT cache {final}"
    finally:
        output, _ = variant.communicate(timeout=900)
    assert variant.returncode == 0, output
    variant_dir = Path(output.strip().splitlines()[-1])
    assert "JIT build" in output and variant_dir.parent == final.parent and variant_dir != final, output
    assert not variant_dir.exists() and not variant_dir.with_name(f"{variant_dir.name}.lock").exists(), output
    assert (library.stat().st_ino, library.read_bytes()) == before
    checks.vote_1bit_equals_brute_force(job)
    checks.vote_kbit_equals_brute_force_or_refuses_before_communicating(job)
    checks.parameters_identical_on_every_rank(job)
    checks.training_matches_brute_force_simulation(job, exact_modes=checks.ORDER_FREE_MODES)
