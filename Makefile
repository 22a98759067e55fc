# Set-up and the two entry points. `make train` and `make test` work on a fresh machine: they build
# the virtual environment (torch 2.13.0 CPU, DeepSpeed 0.19.8, ds_lioncub and its test deps) first.
# Developer targets: `make test-fast` (the in-process tier, seconds) and `make lint` (ruff and mypy).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR ?= cpu
# The venv's tools first: its ninja (a wheel) must build the JIT kernels, not the system's, or the two
# disagree about the build log and rebuild every op on each switch.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv dev-tools train test test-fast lint

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

train: venv
	$(PY) -m examples.compare

# Lint, format check and types, then the whole suite: tests/ and benchmarks/tests/ (pyproject.toml's testpaths).
test: lint
	$(PY) -m pytest -q

# The fast tier: every in-process test (no rank subprocesses, no launchers); seconds once the op is built.
test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: dev-tools
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy ds_lioncub
