# The two entry points of README.md. Both work on a fresh machine: they install what they need into a
# virtual environment of this checkout (.venv, git-ignored), so two clones never re-point each other's kiln.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Tests and recipes find this checkout's `kiln`, `torchrun`, `hadolint`, ... first.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: install quickstart rig test test-fast bench venv generate

venv: $(PY)
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q -e '.[dev]'

# Every checked-in file made from another (the CRD and its chart copy, the chart's RBAC copies, the field
# reference in docs/api.md): kiln.api.generate says which; the tests name this target when one is stale.
generate: $(PY)
	$(PY) -m kiln.api.generate

quickstart: $(PY)
	$(PY) -m pip install -q -e '.[train]'
	$(VENV)/bin/kiln run manifests/samples/quickstart.yaml --output runs/quickstart

# The rig's control plane and S3, its real node (kubelet, containerd, CNI, CoreDNS), kiln's two images
# built from images/ for that node, and the Prometheus server and promtool the tests run (tests/prometheus.py):
# all cached under $(KILN_CACHE_DIR) (default .cache/), so a rerun is fast.
RIG_BUILD := $(PY) -m tests.rig build && $(PY) -m tests.rig build --node && $(PY) -m tests.rig.images \
	&& $(PY) -m tests.prometheus

rig: install
	$(RIG_BUILD)

# The lanes (CONTRIBUTING.md): the fast lane is the pure tests, which need nothing built. The distributed lane
# (torch processes on the CPU) needs nothing built either, but for its few tests on the rig's S3, which run in
# the rig lane. `make test` starts the fast and the distributed lane at once, builds the rig (cached) beside
# them, then runs the rig lane (mostly waiting on servers): on two cores the distributed lane, the longest,
# no longer waits for the fast lane and the rig build. Their output follows the rig lane's.
FAST_LANE := not rig and not distributed and not tools
DIST_LANE := distributed and not rig
RIG_LANE := not ($(FAST_LANE)) and not ($(DIST_LANE))

test-fast: install
	$(PY) -m pytest -m "$(FAST_LANE)" $(PYTEST_ARGS)

FAST_LOG := runs/test-fast.log
DIST_LOG := runs/test-distributed.log

test: install
	@mkdir -p runs
	$(PY) -m pytest -m "$(FAST_LANE)" $(PYTEST_ARGS) > $(FAST_LOG) 2>&1 & fast=$$!; \
	$(PY) -m pytest -m "$(DIST_LANE)" $(PYTEST_ARGS) > $(DIST_LOG) 2>&1 & dist=$$!; \
	$(RIG_BUILD) && $(PY) -m pytest -m "$(RIG_LANE)" $(PYTEST_ARGS); rig=$$?; \
	wait $$fast; fast=$$?; echo "== the fast lane ($(FAST_LOG))"; cat $(FAST_LOG); \
	wait $$dist; distributed=$$?; echo "== the distributed lane ($(DIST_LOG))"; cat $(DIST_LOG); \
	echo "fast lane exit $$fast, rig lane exit $$rig, distributed lane exit $$distributed"; \
	test $$fast -eq 0 && test $$rig -eq 0 && test $$distributed -eq 0

bench: rig
	$(PY) -m tests.bench
