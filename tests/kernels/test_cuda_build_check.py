"""The CUDA op's architectures, and the CUDA build check (``make check-cuda``) failing on broken kernel copies.

The check needs PyPI's CUDA toolkit (``requirements-cuda.txt``), which ``make check-cuda`` installs
before ``make test`` runs the suite; elsewhere these tests skip, saying why, unless
``LIONCUB_REQUIRE_CUDA_TOOLKIT=1`` (set by ``make test``) turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from ds_lioncub.kernels import builders
from ds_lioncub.kernels.builders import LionCubPackingCUDABuilder, choose_cuda_architectures, ops_dir
from ds_lioncub.kernels.cuda_build_check import find_cuda_home

REPO = Path(__file__).resolve().parents[2]
KERNELS = "csrc/cuda/lioncub_packing_kernels.cu"
# What nvcc --list-gpu-arch lists, as compute capabilities: CUDA 13.0 (7.5 and up), CUDA 12.4 (no Blackwell).
CUDA_13_0 = ["7.5", "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "11.0", "10.3", "12.0", "12.1"]
CUDA_12_4 = ["5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0"]


def test_architectures_are_ours_among_what_the_toolkit_builds() -> None:
    assert choose_cuda_architectures(CUDA_13_0) == "7.5;8.0;9.0;10.0;12.0+PTX"
    assert choose_cuda_architectures(CUDA_12_4) == "7.0;7.5;8.0;9.0+PTX"
    assert choose_cuda_architectures(["6.0", "6.1"]) == ""


def test_prebuilt_cuda_op_never_asks_cuda_13_for_compute_60(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed 0.19.8's defaults for a CUDA 13 toolkit are 6.0;6.1;7.0, which CUDA 13 cannot build."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "recorded")  # so that monkeypatch restores it after DeepSpeed sets it
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/nowhere/cuda-13")
    monkeypatch.setattr(builders, "nvcc_architectures", lambda nvcc: CUDA_13_0)
    flags = LionCubPackingCUDABuilder().compute_capability_args()
    assert flags == [
        "-gencode=arch=compute_75,code=sm_75",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_120,code=sm_120",
        "-gencode=arch=compute_120,code=compute_120",
    ]


def test_an_explicit_arch_list_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/nowhere/cuda-13")
    monkeypatch.setattr(builders, "nvcc_architectures", lambda nvcc: CUDA_13_0)
    assert LionCubPackingCUDABuilder().compute_capability_args() == ["-gencode=arch=compute_90,code=sm_90"]


def _toolkit_or_skip() -> None:
    home = find_cuda_home(None)
    if home is not None and (home / "bin" / "nvcc").is_file():
        return
    why = "no CUDA toolkit (make check-cuda installs PyPI's, requirements-cuda.txt)"
    if os.environ.get("LIONCUB_REQUIRE_CUDA_TOOLKIT") == "1":
        pytest.fail(f"{why}, and LIONCUB_REQUIRE_CUDA_TOOLKIT=1 says this run must have it")
    pytest.skip(why)


def _broken_copy(tmp_path: Path, source: str, old: str, new: str) -> tuple[Path, Path]:
    """A copy of the ops folder with ``old`` replaced by ``new`` in ``source``: (the copy, the changed file)."""
    copy = tmp_path / "ops"
    shutil.copytree(ops_dir() / "csrc", copy / "csrc")
    changed = copy / source
    text = changed.read_text()
    assert old in text
    changed.write_text(text.replace(old, new, 1))
    return copy, changed


def _run_check(ops: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ds_lioncub.kernels.cuda_build_check", "--ops-dir", str(ops)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.mark.parametrize(
    "old, new",
    [
        pytest.param("}  // namespace cuda", "this is not CUDA;\n}  // namespace cuda", id="compile-error"),
        pytest.param(
            "}  // namespace cuda",
            "__global__ void lioncub_unused_local() { int unused = 0; }\n}  // namespace cuda",
            id="warning",
            marks=pytest.mark.slow,  # a warning, unlike an error, comes after nvcc's whole front end (~20 s)
        ),
    ],
)
def test_check_fails_on_a_broken_kernel_copy(tmp_path: Path, old: str, new: str) -> None:
    _toolkit_or_skip()
    ops, changed = _broken_copy(tmp_path, KERNELS, old, new)
    result = _run_check(ops)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"failed compiling {changed}" in result.stderr


@pytest.mark.slow  # compiles both sources in full (about a minute on 2 cores) before the link finds it
def test_check_fails_on_a_launcher_declared_but_not_defined(tmp_path: Path) -> None:
    _toolkit_or_skip()
    ops, _ = _broken_copy(tmp_path, KERNELS, "int max_voters() {", "int max_voters_renamed() {")
    result = _run_check(ops)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lioncub symbols undefined" in result.stderr and "lioncub::cuda::max_voters()" in result.stderr
