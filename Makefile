# The two entry points of README.md. Both work on a fresh machine: they install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PYTEST_ARGS ?=

.PHONY: install quickstart rig test bench

install:
	$(PIP) install -q -e '.[dev]'

quickstart:
	$(PIP) install -q -e '.[train]'
	kiln run manifests/samples/quickstart.yaml --output runs/quickstart

rig: install
	$(PYTHON) -m tests.rig build

test: rig
	$(PYTHON) -m pytest $(PYTEST_ARGS)

bench: rig
	$(PYTHON) -m tests.bench
