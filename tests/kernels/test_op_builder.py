"""The DeepSpeed op builders of the packing kernels, and the report (``python -m ds_lioncub.report``) of which
packing path runs and why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ds_lioncub.comm.packing as packing
from ds_lioncub.kernels.builders import LionCubPackingCPUBuilder, LionCubPackingCUDABuilder


def test_cpu_builder_loads_with_a_unique_name(cpu_op) -> None:
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    builder = LionCubPackingCPUBuilder()
    assert builder.name == "lioncub_packing_cpu" and builder.name not in ALL_OPS
    assert LionCubPackingCUDABuilder().name not in ALL_OPS
    assert builder.load() is cpu_op  # cached: one load per process
    assert builder.load_source.startswith(("prebuilt", "JIT cache", "JIT build"))
    assert cpu_op.device == "cpu" and cpu_op.simd()
    for source in builder.sources() + builder.include_paths():
        assert Path(builder.deepspeed_src_path(source)).exists(), source


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch is a CUDA build here")
def test_cuda_builder_says_why_it_cannot_build_on_a_cpu_torch() -> None:
    builder = LionCubPackingCUDABuilder()
    assert not builder.is_compatible()
    assert "CPU-only" in builder.error_log


def test_report_shows_the_active_path(cpu_op) -> None:
    from ds_lioncub.report import report

    text = report(build=True, color=False)
    line = next(line for line in text.splitlines() if line.startswith("active path (cpu)"))
    assert "COMPILED" in line and "lioncub_packing_cpu" in line
    assert "requested mode" in text and "op lioncub_packing_cuda" in text


def test_report_follows_the_environment_variable(cpu_op, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from ds_lioncub.report import main

    monkeypatch.setenv(packing.PACKING_ENV, "torch")
    assert main(["--no-color"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("active path (cpu)"))
    assert "TORCH" in line and "DS_LIONCUB_PACKING=torch" in line


@pytest.mark.parametrize(
    ("listed", "generic"),
    [
        ("9.0a", "9.0"),
        ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
        ("8.0 9.0 10.0f 12.0a", "8.0;9.0;10.0;12.0"),
        ("9.0;9.0a", "9.0"),
        ("7.5;8.6+PTX", "7.5;8.6+PTX"),
    ],
)
def test_architecture_specific_targets_become_their_generic_code(listed: str, generic: str) -> None:
    from ds_lioncub.kernels.builders import generic_architectures

    assert generic_architectures(listed) == generic


def test_a_hopper_image_arch_list_builds_the_generic_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_CUDA_ARCH_LIST=9.0a made DeepSpeed's builder fail ("invalid literal for int() ... '0a'", on an
    H200): a prebuilt op gets sm_90 code, and a JIT build the list torch then reads."""
    builder = LionCubPackingCUDABuilder()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    builder.jit_mode = False
    flags = builder.compute_capability_args()
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
    builder.jit_mode = True
    builder._jit_arch_list = "9.0a"  # what jit_load() captured from the environment
    assert builder.compute_capability_args() == []  # JIT: torch makes the flags from the environment
    assert builder._jit_arch_list == "9.0"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"
