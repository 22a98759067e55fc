# Set-up and the two entry points. `make train` and `make test` work on a fresh machine: they build
# the virtual environment (torch 2.13.0 CPU, DeepSpeed 0.19.8, ds_lioncub and its test deps) first.
# Developer targets: `make test-fast` (the in-process tier, seconds), `make lint` (ruff and mypy) and
# `make check-cuda` (compile and link the CUDA kernels with PyPI's CUDA toolkit; no GPU needed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR ?= cpu
# The venv's tools first (its ninja, deepspeed, ruff, mypy). The JIT op cache no longer depends on which
# ninja PATH finds (ds_lioncub/kernels/jit_cache.py).
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv dev-tools cuda-toolkit train test test-fast lint check-cuda

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,mpi,bench]"
	touch $@

# ruff, mypy and pre-commit, pinned in requirements-dev.txt
dev-tools: $(VENV)/.dev-tools

$(VENV)/.dev-tools: requirements-dev.txt $(VENV)/.installed
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# PyPI's CUDA 13.0 compiler and headers, pinned in requirements-cuda.txt (inert for the CPU torch).
cuda-toolkit: $(VENV)/.cuda-toolkit

$(VENV)/.cuda-toolkit: requirements-cuda.txt $(VENV)/.installed
	$(PY) -m pip install --quiet -r requirements-cuda.txt
	touch $@

# nvcc and g++ on the CUDA op's sources with the builder's own flags, warnings as errors; then the link
# and its symbols (ds_lioncub/kernels/cuda_build_check.py). About a minute on 2 cores.
check-cuda: cuda-toolkit
	$(PY) -m ds_lioncub.kernels.cuda_build_check

train: venv
	$(PY) -m examples.compare

# Lint, format check and types, the CUDA build check, then the whole suite: tests/ and benchmarks/tests/
# (pyproject.toml's testpaths). LIONCUB_REQUIRE_CUDA_TOOLKIT=1: the tests of the CUDA build check must run
# here (check-cuda installed the toolkit), not skip.
test: lint check-cuda
	LIONCUB_REQUIRE_CUDA_TOOLKIT=1 $(PY) -m pytest -q

# The fast tier: every in-process test (no rank subprocesses, no launchers); seconds once the op is built.
test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: dev-tools
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy ds_lioncub
