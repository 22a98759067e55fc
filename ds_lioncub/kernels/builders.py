"""DeepSpeed op builders for the packing kernels (``ops/csrc``): CPU (C++/OpenMP) and CUDA.

Both follow DeepSpeed's op-builder conventions (``deepspeed.ops.op_builder``) with three changes that
an out-of-tree op needs:

- sources are resolved inside this repository (``ops/csrc``), or inside the installed package
  (``ds_lioncub/_ops/csrc``, copied there by ``setup.py``), not inside ``deepspeed/ops``;
- ``load()`` imports our own prebuilt extension (``DS_BUILD_LIONCUB=1 pip install .``) when it is
  there; DeepSpeed's ``installed_ops`` only knows DeepSpeed's ops;
- a JIT build goes to ``<repo>/build/torch_extensions`` when run from a source checkout (unless
  ``TORCH_EXTENSIONS_DIR`` says otherwise), so one build serves every process and test session,
  and it announces itself with one log line (a first build takes about a minute on 2 cores);
- that cache holds one immutable directory per build key (:mod:`.jit_cache`): the key follows the
  sources, flags, compiler, torch and CPU, not PATH, and a build never rewrites a library that
  another process may have loaded.

``setup.py`` loads this file by its path at install time, before ds_lioncub is installed and
without importing the package (whose import registers LionCub with DeepSpeed). So at module level it
imports only the standard library, torch and DeepSpeed's op builders; the package logger is imported
when a JIT build first logs, which only happens inside an imported ds_lioncub.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # ds_lioncub (this is kernels/builders.py): _ops/csrc when installed
REPO_DIR = PACKAGE_DIR.parent  # the checkout: ops/csrc and build/ in a source tree
BUILD_VAR = "DS_BUILD_LIONCUB"
_LOAD_SOURCES: dict[str, str] = {}
# The GPU generations a prebuilt CUDA op is compiled for when TORCH_CUDA_ARCH_LIST does not say: V100 (7.0),
# T4 (7.5), A100 (8.0), H100/H200 (9.0), B200 (10.0), RTX 50xx (12.0). Machine code for X.0 also runs on
# every X.y after it (A10 and L4 run the 8.0 code), so the minor versions add build time and nothing
# else for these memory-bound kernels. The toolkit's own list (nvcc --list-gpu-arch) decides which of
# these it can build: CUDA 13 dropped 7.0, CUDA 12.0-12.7 lack 10.0 and 12.0.
CUDA_TARGET_ARCHITECTURES = ("7.0", "7.5", "8.0", "9.0", "10.0", "12.0")


def __getattr__(name: str) -> Any:
    # The package logger, imported on use (see the module docstring); ds_lioncub.op_builder re-exported it.
    if name != "get_logger":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ds_lioncub._logging import get_logger

    return get_logger


def _logger() -> logging.Logger:
    return __getattr__("get_logger")()


def ops_dir() -> Path:
    """Where the kernel sources are: ``<repo>/ops`` in a checkout, ``ds_lioncub/_ops`` when installed."""
    for candidate in (REPO_DIR / "ops", PACKAGE_DIR / "_ops"):
        if (candidate / "csrc").is_dir():
            return candidate
    return REPO_DIR / "ops"


def resolve_source(code_path: str, root: Path | None = None) -> Path:
    """A builder's source or include path (``ops/csrc/...``) inside ``root`` (default :func:`ops_dir`)."""
    if os.path.isabs(code_path):
        return Path(code_path)
    relative = Path(code_path)
    if relative.parts and relative.parts[0] == "ops":
        relative = Path(*relative.parts[1:])
    return (ops_dir() if root is None else root) / relative


def nvcc_architectures(nvcc: str) -> list[str]:
    """The compute capabilities ``nvcc`` can build, as "8.0", "9.0", ... (empty if it cannot be asked)."""
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for word in listed.split():
        digits = word.removeprefix("compute_")
        if digits.isdigit() and len(digits) >= 2:  # compute_90 -> 9.0, compute_120 -> 12.0
            found.append(f"{digits[:-1]}.{digits[-1]}")
    return found


def choose_cuda_architectures(available: list[str]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for a prebuilt op: :data:`CUDA_TARGET_ARCHITECTURES` that the toolkit can build,
    the newest also as PTX (which the driver compiles for GPUs newer than all of them); "" if none."""
    chosen = [arch for arch in CUDA_TARGET_ARCHITECTURES if arch in available]
    if not chosen:
        return ""
    return ";".join(chosen[:-1] + [chosen[-1] + "+PTX"])


# One TORCH_CUDA_ARCH_LIST entry: "9.0", "9.0a" (architecture-specific), "10.0f" (family), each maybe "+PTX".
_ARCH_ENTRY = re.compile(r"(\d+\.\d+)([a-z]*)(\+PTX)?")


def generic_architectures(arch_list: str) -> str:
    """``arch_list`` (a ``TORCH_CUDA_ARCH_LIST``) with the suffixes of architecture-specific and family targets
    dropped: "8.0;9.0a" -> "8.0;9.0", "10.0f+PTX" -> "10.0+PTX"; ";"-separated, other entries as they are.

    Images built for Hopper often set such entries (9.0a), and DeepSpeed 0.19.8 cannot parse them: its
    builder fails with ``invalid literal for int() with base 10: '0a'`` (seen on an H200). The packing
    kernels use no architecture-specific instruction, so the generic code of the same generation is
    the same kernel for these GPUs."""
    entries = [entry.strip() for entry in arch_list.replace(" ", ";").split(";") if entry.strip()]
    generic = []
    for entry in entries:
        match = _ARCH_ENTRY.fullmatch(entry)
        generic.append(match.group(1) + (match.group(3) or "") if match else entry)
    return ";".join(dict.fromkeys(generic))


def default_build_root() -> Path | None:
    """JIT cache root: ``TORCH_EXTENSIONS_DIR``, else ``<repo>/build/torch_extensions`` in a writable
    source checkout, else None (torch's own default, ``~/.cache/torch_extensions``)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if (REPO_DIR / "ops" / "csrc").is_dir() and os.access(REPO_DIR, os.W_OK):
        return REPO_DIR / "build" / "torch_extensions"
    return None


@contextmanager
def _jit_environment(build_root: Path) -> Iterator[None]:
    """TORCH_EXTENSIONS_DIR set to ``build_root`` and ninja on PATH (the venv's bin may not be), restored after."""
    saved = {key: os.environ.get(key) for key in ("TORCH_EXTENSIONS_DIR", "PATH")}
    try:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(build_root)
        if shutil.which("ninja") is None:
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), saved["PATH"] or ""])
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Build keys by op name: computed once per process (it reads the sources and asks the compiler its version).
_JIT_KEYS: dict[str, str] = {}


class _LionCubBuilderMixin:
    """Source resolution and load() shared by the CPU and CUDA builders."""

    NAME: str
    name: str
    SOURCES: tuple[str, ...] = ()

    @property
    def load_source(self) -> str | None:
        """How load() got the module: "prebuilt <file>", "JIT cache <dir>" or "JIT build <dir> (N s)"."""
        return _LOAD_SOURCES.get(self.name)

    def absolute_name(self) -> str:
        return f"ds_lioncub.{self.NAME}_op"

    def sources(self) -> list[str]:
        # relative to the repository root: what setup.py's Extension wants (it runs there)
        return list(self.SOURCES)

    def include_paths(self) -> list[str]:
        return ["ops/csrc/includes"]

    def deepspeed_src_path(self, code_path: str) -> str:
        return str(resolve_source(code_path))

    def jit_root(self) -> Path:
        """The JIT cache: :func:`default_build_root`, else torch's default root as torch names it."""
        root = default_build_root()
        if root is None:  # torch's default, as torch.utils.cpp_extension._get_build_directory names it
            from torch.utils.cpp_extension import get_default_build_root

            accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
            root = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}"
        return root

    def jit_key_files(self) -> list[Path]:
        """The files whose bytes go into a build: sources, headers, and this file (which holds the flags)."""
        sources = [Path(self.deepspeed_src_path(path)) for path in self.sources()]
        headers = sorted(
            header
            for include in self.include_paths()
            for header in Path(self.deepspeed_src_path(include)).glob("*")
            if header.suffix in (".h", ".cuh", ".hpp")
        )
        return [*sources, *headers, Path(__file__)]

    def jit_key_parts(self) -> list[str]:
        """What else decides the library's bytes, besides :meth:`jit_key_files` (never PATH itself)."""
        from ds_lioncub.kernels.jit_cache import compiler_identity, cpu_features

        cxx_args = self.cxx_args()  # type: ignore[attr-defined]
        parts = [f"deepspeed {deepspeed.__version__}", repr(cxx_args), compiler_identity(os.environ.get("CXX", "c++"))]
        if any(arg in ("-march=native", "-mcpu=native") for arg in cxx_args):
            parts.append(cpu_features())
        return parts

    def jit_key(self) -> str:
        """The build key (:mod:`.jit_cache`): the same for every process of one machine and installation."""
        key = _JIT_KEYS.get(self.name)
        if key is None:
            from ds_lioncub.kernels.jit_cache import build_key

            key = _JIT_KEYS[self.name] = build_key(self.jit_key_files(), self.jit_key_parts())
        return key

    def jit_build_dir(self) -> Path:
        """Where this op's JIT build for this machine and installation lives (complete or not yet built)."""
        from ds_lioncub.kernels.jit_cache import keyed_dir

        return keyed_dir(self.jit_root(), self.name, self.jit_key())

    def jit_cached(self) -> bool:
        """True when the JIT build of this op for this key sits in the cache (loading it takes about a second)."""
        from ds_lioncub.kernels.jit_cache import library_in

        return library_in(self.jit_build_dir(), self.name) is not None

    def prebuilt_available(self) -> bool:
        return importlib.util.find_spec(self.absolute_name()) is not None

    def load(self, verbose: bool = False) -> Any:
        cached = OpBuilder._loaded_ops.get(self.name)
        if cached is not None:
            return cached
        module = None
        prebuilt_error = None
        if self.prebuilt_available():
            try:
                module = importlib.import_module(self.absolute_name())
                _LOAD_SOURCES[self.name] = f"prebuilt {module.__file__}"
            except (ImportError, OSError) as error:  # built against another torch: rebuild below
                prebuilt_error = error
        if module is None:
            module = self._jit(verbose, prebuilt_error)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def _jit(self, verbose: bool, prebuilt_error: BaseException | None) -> Any:
        from ds_lioncub.kernels.jit_cache import load_or_build

        reason = f" (prebuilt module unusable: {prebuilt_error})" if prebuilt_error else ""

        def announce(where: Path) -> None:
            _logger().info(
                f"building op {self.name} with JIT on first use, 10-45 s on 2 cores, once; cache: {where}{reason}"
            )

        def build_into(staging_root: Path) -> Any:
            with _jit_environment(staging_root):
                return self.jit_load(verbose=verbose)  # type: ignore[attr-defined]

        start = time.time()
        module, built = load_or_build(self.jit_root(), self.name, self.jit_key(), build_into, announce)
        where = self.jit_build_dir()
        _LOAD_SOURCES[self.name] = f"JIT build {where} ({time.time() - start:.0f} s)" if built else f"JIT cache {where}"
        return module


class LionCubPackingCPUBuilder(_LionCubBuilderMixin, CPUOpBuilder):
    """The CPU kernels: C++ with at::parallel_for (OpenMP) and AVX2/F16C via -march=native."""

    BUILD_VAR = BUILD_VAR
    NAME = "lioncub_packing_cpu"
    SOURCES = ("ops/csrc/cpu/lioncub_packing.cpp",)

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def cxx_args(self) -> list[str]:
        # DeepSpeed's CPU flags (-O3, -march=native, -fopenmp) without -g and without its py-cpuinfo
        # probe (two subprocesses, ~3 s on every load, even of a cached build); the kernels pick their
        # SIMD path from the compiler's own macros (__AVX2__, __F16C__). No -ffast-math anywhere:
        # the kernels must round exactly as torch does. -ffp-contract=off: the fused step's parameter
        # update rounds p * decay before adding -lr * s, as torch's two operations do; GCC would
        # otherwise fuse them into one fma (the kernels' intended fmas are written as fma calls).
        machine = platform.machine().lower()
        if machine.startswith(("ppc", "powerpc")):
            arch = "-mcpu=native"
        elif machine.startswith("riscv64"):
            arch = "-march=rv64gc"
        else:
            arch = "-march=native"
        return ["-O3", "-Wno-reorder", arch, "-fopenmp", "-ffp-contract=off"]


class LionCubPackingCUDABuilder(_LionCubBuilderMixin, CUDAOpBuilder):
    """The CUDA kernels (nvcc). Needs a CUDA build of torch; a CPU-only torch reports incompatible."""

    BUILD_VAR = BUILD_VAR
    NAME = "lioncub_packing_cuda"
    SOURCES = (
        "ops/csrc/cuda/lioncub_packing_cuda.cpp",
        "ops/csrc/cuda/lioncub_packing_kernels.cu",
        "ops/csrc/cuda/lioncub_bandwidth_kernels.cu",  # the second generation (v2)
    )

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def is_compatible(self, verbose: bool = False) -> bool:
        if torch.version.hip is not None:
            self.error_log = "ROCm builds of torch are not supported by the lioncub CUDA kernels"
            return False
        if torch.version.cuda is None:
            self.error_log = "torch is a CPU-only build (torch.version.cuda is None)"
            return False
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            self.error_log = "no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)"
            return False
        return super().is_compatible(verbose)

    def jit_key_parts(self) -> list[str]:
        # A JIT build targets TORCH_CUDA_ARCH_LIST, else the visible GPUs, with the toolkit's nvcc.
        from torch.utils.cpp_extension import CUDA_HOME

        from ds_lioncub.kernels.jit_cache import compiler_identity

        listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        # The architectures, not how many GPUs of each this process sees (CUDA_VISIBLE_DEVICES, a scheduler's binding).
        visible = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        targets = listed or repr(sorted(visible))
        nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else "nvcc"
        return [*super().jit_key_parts(), f"CUDA targets {targets}", compiler_identity(nvcc)]

    def nvcc_args(self) -> list[str]:
        # DeepSpeed adds --use_fast_math; the L1 quantizer must multiply and round exactly as torch.
        return [arg for arg in super().nvcc_args() if arg != "--use_fast_math"]

    def cxx_args(self) -> list[str]:
        return [arg for arg in super().cxx_args() if arg != "-g"]

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        # A prebuilt op (setup.py, not JIT) with no TORCH_CUDA_ARCH_LIST: DeepSpeed 0.19.8 would take its
        # defaults, 6.0;6.1;7.0 (+8.0;8.6;9.0 on CUDA 11/12 only), which CUDA 13 cannot build ("Unsupported
        # gpu architecture 'compute_60'") and which miss Hopper and Blackwell there. We ask the toolkit which
        # it can build and take ours among them. JIT builds keep DeepSpeed's rule: the visible devices.
        # Architecture-specific entries (9.0a) break DeepSpeed's parsing of the list: build their generic
        # code instead, from the list a JIT build captured and from the environment alike.
        listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if listed and generic_architectures(listed) != listed.strip():
            _logger().info(
                f"TORCH_CUDA_ARCH_LIST={listed!r}: building {generic_architectures(listed)!r} for {self.NAME}"
            )
            os.environ["TORCH_CUDA_ARCH_LIST"] = generic_architectures(listed)
        captured = getattr(self, "_jit_arch_list", None)
        if captured:
            self._jit_arch_list = generic_architectures(captured)
        if not self.jit_mode and cross_compile_archs is None and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            from torch.utils.cpp_extension import CUDA_HOME

            if CUDA_HOME is not None:
                nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc")
                cross_compile_archs = choose_cuda_architectures(nvcc_architectures(nvcc))
        return list(super().compute_capability_args(cross_compile_archs or None))


PackingBuilder = LionCubPackingCPUBuilder | LionCubPackingCUDABuilder


def builders() -> dict[str, PackingBuilder]:
    """The builder for each device type."""
    return {"cpu": LionCubPackingCPUBuilder(), "cuda": LionCubPackingCUDABuilder()}


__all__ = [
    "BUILD_VAR",
    "LionCubPackingCPUBuilder",
    "LionCubPackingCUDABuilder",
    "PackingBuilder",
    "CUDA_TARGET_ARCHITECTURES",
    "builders",
    "choose_cuda_architectures",
    "default_build_root",
    "nvcc_architectures",
    "ops_dir",
    "resolve_source",
]
