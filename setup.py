"""ds_lioncub: Lion Cub (communication-efficient distributed Lion) as a DeepSpeed extension.

The packing kernels (ops/csrc) build on first use (JIT, cached). To prebuild them at install time,
as DeepSpeed's DS_BUILD_* variables do:

    DS_BUILD_LIONCUB=1 pip install --no-build-isolation .     (or DS_BUILD_OPS=1; DS_BUILD_LIONCUB=0 wins)

--no-build-isolation lets the build see the installed torch and DeepSpeed (pip would otherwise build
in a fresh environment without them). The CUDA op is added when torch is a CUDA build and nvcc is
found; the CPU op always.
"""

import importlib.util
import os
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _wants_prebuilt_ops() -> bool:
    flag = os.environ.get("DS_BUILD_LIONCUB")
    if flag is not None:
        return flag == "1"
    return os.environ.get("DS_BUILD_OPS") == "1"


class BuildPyWithKernelSources(build_py):
    """Ships ops/csrc inside the package (ds_lioncub/_ops/csrc) so an installed copy can JIT-build."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "ds_lioncub" / "_ops" / "csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(HERE / "ops" / "csrc", target)


def _extensions():
    """(ext_modules, build_ext class) for DS_BUILD_LIONCUB=1, else ([], None)."""
    if not _wants_prebuilt_ops():
        return [], None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension
    except ImportError as error:
        raise SystemExit(
            f"DS_BUILD_LIONCUB=1 needs torch and deepspeed importable at build time ({error}). Install them "
            f"first, then: DS_BUILD_LIONCUB=1 pip install --no-build-isolation ."
        ) from None
    # the builders by path: importing the ds_lioncub package would run its DeepSpeed registration
    spec = importlib.util.spec_from_file_location(
        "_lioncub_op_builder", HERE / "ds_lioncub" / "kernels" / "builders.py"
    )
    op_builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op_builder)
    extensions = [op_builder.LionCubPackingCPUBuilder().builder()]
    cuda = op_builder.LionCubPackingCUDABuilder()
    if torch.version.cuda is not None and CUDA_HOME is not None:
        extensions.append(cuda.builder())
    else:
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA_HOME"
        print(f"ds_lioncub: skipping the CUDA packing op: {why}")
    print(f"ds_lioncub: prebuilding {', '.join(ext.name for ext in extensions)}")
    return extensions, BuildExtension


EXT_MODULES, BUILD_EXT = _extensions()
CMDCLASS = {"build_py": BuildPyWithKernelSources}
if BUILD_EXT is not None:
    CMDCLASS["build_ext"] = BUILD_EXT

setup(
    name="ds_lioncub",
    version=re.search(r'__version__ = "([^"]+)"', (HERE / "ds_lioncub" / "_version.py").read_text()).group(1),
    description="Lion Cub for DeepSpeed: Lion with 1-8 bit compressed majority-vote communication",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_lioncub", "ds_lioncub.*"]),
    # The convergence study's summary, read by the planner and compression="auto".
    package_data={"ds_lioncub.planner": ["convergence_evidence.json"]},
    python_requires=">=3.11",
    # torch is pinned by the Makefile (the CPU build on this machine); any torch >= 2.4 works.
    # tqdm: python -m ds_lioncub.simulate's progress bar.
    install_requires=["torch>=2.4", "deepspeed==0.19.8", "pydantic>=2", "numpy", "tqdm"],
    extras_require={
        "mpi": ["mpi4py", "mpich"],
        "cuda": ["cupy-cuda12x"],
        # transformers and accelerate: the Hugging Face Trainer test (tests/integration/test_hf_trainer.py), pinned
        # to the versions it was written against (its CPU set-up works around their handling of a machine with no GPU).
        "test": ["pytest", "pytest-timeout", "tqdm", "transformers==5.24.0", "accelerate==1.15.0"],
        "bench": ["matplotlib"],  # bench_train.py's loss plots (python -m ds_lioncub.simulate --plot needs it too)
    },
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
