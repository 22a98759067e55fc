"""Compile and link the CUDA packing op without a GPU: ``python -m ds_lioncub.kernels.cuda_build_check``.

CI has no GPU and a CPU build of torch, whose ``CUDAExtension`` and ``load`` refuse to build CUDA code
(torch ignores ``CUDA_HOME`` when it was built without CUDA). This check drives ``nvcc`` and ``g++``
itself, from :class:`~ds_lioncub.kernels.builders.LionCubPackingCUDABuilder`'s own sources and
flags (one source of truth: a source or flag added to the builder is checked here too), with what
torch's ``CUDAExtension`` would add (its nvcc defines, the extension's name, ``-fPIC``), and with
warnings as errors on both compilers. Then it links the two objects into one shared object and
checks that no ``lioncub`` symbol is left undefined (a launcher declared in the header but never
defined, or defined with other arguments, fails here rather than on a GPU machine's first import)
and that the module's init function is there. Symbols of ``c10::cuda`` and the CUDA runtime stay
undefined: a CPU torch cannot provide them; a CUDA torch does at import.

Two things differ from a build against a CUDA torch, and why: ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE``,
because the CPU wheel lacks ``c10/cuda/impl/cuda_cmake_macros.h`` (generated when torch is built
with CUDA; the macro makes c10 take its defaults instead); and torch's own headers and the
toolkit's are included as system headers (``-isystem``), so that warnings are only ours.

The toolkit is PyPI's CUDA 13 (``requirements-cuda.txt``, installed by ``make check-cuda``: nvcc,
crt, nvvm, runtime and cccl under ``site-packages/nvidia/cu13``), or ``--cuda-home DIR``. Exit
status 0: compiled, linked and checked; 1: a compiler, the linker or the symbol check failed (the
message names the file); 2: no toolkit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from ds_lioncub.kernels.builders import LionCubPackingCUDABuilder, ops_dir, resolve_source

# Warnings as errors: nvcc's own (-Werror all-warnings) and the host compiler's, for both sources.
NVCC_STRICT = ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror"]
CXX_STRICT = ["-Wall", "-Wextra", "-Werror"]
# Only in this check: see the module docstring.
CPU_TORCH_DEFINES = ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]


class CheckFailed(Exception):
    """A step failed; the message says which file and shows the tool's output."""


@dataclass(frozen=True)
class Step:
    """One compiler run: the source it compiles, the object it writes and the command."""

    source: Path
    output: Path
    command: list[str]

    @property
    def log(self) -> Path:
        """The compiler's output."""
        return self.output.with_suffix(".log")


def pip_cuda_home() -> Path | None:
    """``site-packages/nvidia/cu13`` (PyPI's CUDA 13 toolkit) when its nvcc is installed beside this Python."""
    for directory in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")):
        candidate = Path(directory) / "nvidia" / "cu13"
        if (candidate / "bin" / "nvcc").is_file():
            return candidate
    return None


def find_cuda_home(given: str | None) -> Path | None:
    """``given``, else PyPI's toolkit in this venv, else ``CUDA_HOME`` or ``CUDA_PATH``, else nvcc on PATH."""
    if given:
        return Path(given)
    found = pip_cuda_home()
    if found is not None:
        return found
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parents[1] if nvcc else None


def builder_flags(cuda_home: Path) -> tuple[LionCubPackingCUDABuilder, list[str], list[str]]:
    """The builder and its nvcc and C++ flags for a prebuilt op (what ``DS_BUILD_LIONCUB=1`` passes), for ``cuda_home``.

    DeepSpeed's builder asks ``torch.utils.cpp_extension.CUDA_HOME`` for the toolkit's version (its
    ``-std``) and our builder asks it which architectures it can build; a CPU torch leaves it None, so
    it is pointed at ``cuda_home`` while the flags are read.
    """
    builder = LionCubPackingCUDABuilder()
    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = str(cuda_home)
    saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        nvcc_args = builder.strip_empty_entries(builder.nvcc_args())
        cxx_args = builder.strip_empty_entries(builder.cxx_args())
    finally:
        cpp_extension.CUDA_HOME = saved
        # DeepSpeed writes the chosen list into TORCH_CUDA_ARCH_LIST (for torch's BuildExtension): undo it
        if saved_arch_list is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list
    if builder.enable_bf16:  # as DeepSpeed's builder() adds it
        nvcc_args.append("-DBF16_AVAILABLE")
        cxx_args.append("-DBF16_AVAILABLE")
    return builder, nvcc_args, cxx_args


def plan_steps(cuda_home: Path, root: Path, work: Path) -> tuple[list[Step], list[str], str]:
    """The compiler runs for the builder's sources under ``root`` (an ``ops`` folder), the nvcc flags, and the
    module's name."""
    builder, nvcc_args, cxx_args = builder_flags(cuda_home)
    name = builder.name  # a JIT build's module name (setup.py's is the last part of absolute_name())
    includes = [f"-I{resolve_source(path, root)}" for path in builder.include_paths()]
    system = [*cpp_extension.include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    system_includes = [flag for path in [*system, str(cuda_home / "include")] for flag in ("-isystem", path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    common = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", abi, *CPU_TORCH_DEFINES]
    nvcc = str(cuda_home / "bin" / "nvcc")
    compiler = os.environ.get("CXX", "g++")
    steps = []
    for path in builder.sources():
        source = resolve_source(path, root)
        output = work / (source.name + ".o")
        if source.suffix == ".cu":
            command = [
                nvcc,
                "-c",
                str(source),
                "-o",
                str(output),
                *common,
                *cpp_extension.COMMON_NVCC_FLAGS,
                "-Xcompiler",
                "-fPIC",
                *nvcc_args,
                *NVCC_STRICT,
                *includes,
                *system_includes,
            ]
        else:
            command = [compiler, "-c", str(source), "-o", str(output), "-fPIC", *common, *cxx_args, *CXX_STRICT]
            command += [*includes, *system_includes]
        steps.append(Step(source, output, command))
    return steps, nvcc_args, name


def run_steps(steps: Sequence[Step]) -> dict[Path, float]:
    """Runs the compilers at once (nvcc and g++ on CI's 2 cores); the first failure stops the others and raises.

    Returns each source's seconds."""
    start = time.perf_counter()
    running = {}
    for step in steps:  # output to a file beside the object: a pipe left unread could fill and stall the compiler
        with step.log.open("w") as log:
            running[step.source] = (step, subprocess.Popen(step.command, stdout=log, stderr=subprocess.STDOUT))
    seconds: dict[Path, float] = {}
    try:
        while running:
            for source, (step, process) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[source]
                if process.returncode != 0:
                    output = step.log.read_text(errors="replace")
                    raise CheckFailed(
                        f"LionCub: the CUDA build check failed compiling {step.source} (exit {process.returncode}):\n"
                        f"{output}\ncommand: {' '.join(step.command)}"
                    )
                seconds[source] = time.perf_counter() - start
            time.sleep(0.05)
    finally:
        for _, process in running.values():  # only after a failure: the others' results no longer matter
            process.kill()
            process.wait()
    return seconds


def undefined_symbols(library: Path) -> list[str]:
    """The undefined dynamic symbols of ``library``, demangled (``nm -D -u -C``)."""
    listed = subprocess.run(["nm", "-D", "-u", "-C", str(library)], capture_output=True, text=True, check=True)
    return [line.split(maxsplit=1)[-1] for line in listed.stdout.splitlines() if line.strip()]


def defined_symbols(library: Path) -> list[str]:
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[-1] for line in listed.splitlines() if line.strip()]


def check(cuda_home: Path, root: Path, work: Path, log: bool = True) -> dict[str, float | int | str]:
    """Compile, link and check the symbols; raises :class:`CheckFailed`. Returns what was measured."""
    steps, nvcc_args, name = plan_steps(cuda_home, root, work)
    gencodes = [arg.removeprefix("-gencode=") for arg in nvcc_args if arg.startswith("-gencode")]
    if log:
        print(f"cuda_build_check: {cuda_home} ({_nvcc_release(cuda_home)}), architectures: {', '.join(gencodes)}")
    start = time.perf_counter()
    measured: dict[str, float | int | str] = {}
    for source, seconds in run_steps(steps).items():
        measured[f"{source.name} seconds"] = round(seconds, 1)
        if log:
            size = (work / (source.name + ".o")).stat().st_size
            print(f"  compiled {source.name} in {seconds:.1f} s ({size:,} bytes)")
    library = work / f"{name}.so"
    compiler = os.environ.get("CXX", "g++")
    linked = subprocess.run(
        [compiler, "-shared", "-o", str(library), *(str(step.output) for step in steps)], capture_output=True, text=True
    )
    if linked.returncode != 0:
        raise CheckFailed(f"LionCub: the CUDA build check failed linking {library}:\n{linked.stdout}{linked.stderr}")
    ours = [symbol for symbol in undefined_symbols(library) if "lioncub" in symbol.lower()]
    if ours:
        raise CheckFailed(
            f"LionCub: the CUDA build check found lioncub symbols undefined in {library} (declared, never "
            f"defined with these arguments in {', '.join(str(step.source) for step in steps)}):\n  " + "\n  ".join(ours)
        )
    if f"PyInit_{name}" not in defined_symbols(library):
        raise CheckFailed(f"LionCub: the CUDA build check found no PyInit_{name} in {library} (no PYBIND11_MODULE?).")
    measured["total seconds"] = round(time.perf_counter() - start, 1)
    measured["shared object bytes"] = library.stat().st_size
    measured["architectures"] = " ".join(gencodes)
    if log:
        print(
            f"cuda_build_check: OK: {library.name} ({library.stat().st_size:,} bytes), no undefined lioncub symbol, "
            f"{measured['total seconds']} s"
        )
    return measured


def _nvcc_release(cuda_home: Path) -> str:
    try:
        text = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "nvcc not runnable"
    return next((line.strip() for line in text.splitlines() if "release" in line), "unknown release")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ds_lioncub.kernels.cuda_build_check",
        description="Compile and link the CUDA packing op with nvcc and g++ (no GPU needed), warnings as errors.",
    )
    parser.add_argument("--cuda-home", metavar="DIR", help="the CUDA toolkit (default: PyPI's, in this venv)")
    parser.add_argument(
        "--ops-dir", metavar="DIR", help="an ops folder holding csrc/ to check instead of this checkout's (tests)"
    )
    parser.add_argument("--keep", metavar="DIR", help="write the objects there (default: a temporary folder)")
    args = parser.parse_args(argv)
    cuda_home = find_cuda_home(args.cuda_home)
    if cuda_home is None or not (cuda_home / "bin" / "nvcc").is_file():
        print(
            "LionCub: no CUDA toolkit found for the CUDA build check; run make check-cuda (it installs PyPI's, "
            "requirements-cuda.txt), or pass --cuda-home DIR.",
            file=sys.stderr,
        )
        return 2
    root = Path(args.ops_dir) if args.ops_dir else ops_dir()
    try:
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            check(cuda_home, root, Path(args.keep))
        else:
            with tempfile.TemporaryDirectory(prefix="lioncub_cuda_check_") as work:
                check(cuda_home, root, Path(work))
    except CheckFailed as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
