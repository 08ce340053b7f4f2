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
rig: install
	$(PY) -m tests.rig build
	$(PY) -m tests.rig build --node
	$(PY) -m tests.rig.images
	$(PY) -m tests.prometheus

# The lanes (CONTRIBUTING.md): the fast lane is the pure tests, which need nothing built; `make test` runs it
# first, then builds the rig (cached) and runs the rest: tools, torch.distributed processes, the rig.
FAST_LANE := not rig and not distributed and not tools

test-fast: install
	$(PY) -m pytest -m "$(FAST_LANE)" $(PYTEST_ARGS)

# The distributed lane (torch processes: CPU) and the rig lane (mostly waiting on servers) side by side: on two
# cores that takes ~20 min less than one after the other. The distributed lane's output follows the rig lane's.
DIST_LOG := runs/test-distributed.log

test: test-fast rig
	@mkdir -p runs
	$(PY) -m pytest -m "distributed" $(PYTEST_ARGS) > $(DIST_LOG) 2>&1 & dist=$$!; \
	$(PY) -m pytest -m "not ($(FAST_LANE)) and not distributed" $(PYTEST_ARGS); rig=$$?; \
	wait $$dist; distributed=$$?; echo "== the distributed lane ($(DIST_LOG))"; cat $(DIST_LOG); \
	echo "rig lane exit $$rig, distributed lane exit $$distributed"; test $$rig -eq 0 && test $$distributed -eq 0

bench: rig
	$(PY) -m tests.bench
