"""ds_lioncub: Lion Cub (communication-efficient distributed Lion) as a DeepSpeed extension."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="ds_lioncub",
    version="0.1.0",
    description="Lion Cub for DeepSpeed: Lion with 1-8 bit compressed majority-vote communication",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_lioncub", "ds_lioncub.*"]),
    python_requires=">=3.11",
    # torch is pinned by the Makefile (the CPU build on this machine); any torch >= 2.4 works.
    install_requires=["torch>=2.4", "deepspeed==0.19.8", "pydantic>=2", "numpy"],
    extras_require={
        "mpi": ["mpi4py", "mpich"],
        "cuda": ["cupy-cuda12x"],
        "test": ["pytest", "pytest-timeout", "tqdm"],
    },
)
