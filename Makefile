# Set-up and the two entry points. `make train` and `make test` work on a fresh machine: they build
# the virtual environment (torch 2.13.0 CPU, DeepSpeed 0.19.8, ds_lioncub and its test deps) first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR ?= cpu
# The venv's tools first: its ninja (a wheel) must build the JIT kernels, not the system's, or the two
# disagree about the build log and rebuild every op on each switch.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv train test

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,mpi,bench]"
	touch $@

train: venv
	$(PY) examples/compare.py

test: venv
	$(PY) -m pytest -q --timeout=900 tests
