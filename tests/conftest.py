"""Shared pytest fixtures: the real rig (control plane + S3) and a fresh namespace per test."""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path

import pytest

# The tools tests run by name (kiln, torchrun, hadolint, check-jsonschema) are this checkout's: the ones next to
# the Python running pytest (.venv/bin), also when pytest is started as .venv/bin/python -m pytest without
# activating the venv, so a kiln installed elsewhere (another clone's) is never the one tested.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


@pytest.fixture(scope="session")
def rig():
    """The running rig (tests/rig): reused if healthy, otherwise built and started here.

    It stops at the end of the session only if this session started it and no other
    pytest session on the machine is still using it (KILN_RIG_KEEP=1 keeps it running).
    """
    from tests.rig import cluster

    pid = os.getpid()
    rig, started = cluster.up(lease_pid=pid)
    try:
        yield rig
    finally:
        cluster.release(pid, stop_if_unused=started and os.environ.get("KILN_RIG_KEEP") != "1")


@pytest.fixture(scope="session")
def kueue(rig):
    """Kueue on the rig (tests/rig/kueue.py): started here unless it runs already; it stops with the rig.
    The module: `cluster_queue()`, `local_queue()`, QUEUE_LABEL, FLAVOR."""
    from tests.rig import kueue

    kueue.up(rig)
    return kueue


@pytest.fixture(scope="session")
def real_node(rig):
    """The rig's real node (tests/rig/node.py): a kubelet with containerd that runs containers.

    Started (and built, the first time) here unless it runs already; it stops with the rig.
    Pods need `real_node.toleration` (and `real_node.node_selector` to land nowhere else),
    images loaded with `real_node.import_image(tar)` and `imagePullPolicy: Never`.
    """
    from tests.rig import node

    return node.up(rig)


@pytest.fixture
def namespace(rig, request):
    """A fresh namespace (with its default ServiceAccount ready), deleted after the test."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    rig.kubectl("create", "namespace", name)
    rig.wait_for(
        f"ServiceAccount default in {name}",
        lambda: rig.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
    )
    try:
        yield name
    finally:
        rig.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_node: runs containers on the rig's real node (fixture real_node)")
    config.addinivalue_line("markers", "tools: builds or installs an external tool into $KILN_CACHE_DIR/tools the "
                                       "first time (promtool, actionlint, tekton-lint, kfp)")


# Fixtures that build a tool into the cache on first use (tests/tools.py; here, tests/prometheus.py,
# tests/unit/test_delivery_pipelines.py).
TOOL_FIXTURES = {"promtool", "actionlint", "tekton_lint", "kfp_python", "checkov"}
# Folders whose every test starts real processes or servers, whatever its own markers say.
FOLDER_LANES = {"distributed": "distributed", "integration": "rig", "e2e": "rig"}


def pytest_collection_modifyitems(items):
    """The lanes (CONTRIBUTING.md): a test's markers say what it needs, so `make test-fast` can run just the
    pure ones (`-m "not rig and not distributed and not tools"`) with nothing built."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "rig" in fixtures:
            item.add_marker(pytest.mark.rig)
        if "real_node" in fixtures:
            item.add_marker(pytest.mark.real_node)
        if fixtures & TOOL_FIXTURES:
            item.add_marker(pytest.mark.tools)
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_LANES:
            item.add_marker(getattr(pytest.mark, FOLDER_LANES[folder]))


ACTIONLINT = "v1.7.12"
CHECKOV = ["checkov==3.3.30"]


@pytest.fixture(scope="session")
def actionlint() -> Path:
    """The GitHub Actions linter (tests/unit/test_delivery_pipelines.py, test_delivery_release.py)."""
    from tests.tools import go_installed

    return go_installed("github.com/rhysd/actionlint/cmd/actionlint", ACTIONLINT)


@pytest.fixture(scope="session")
def checkov() -> Path:
    """checkov, the IaC scanner (tests/unit/test_delivery_checkov.py), in a virtualenv of its own."""
    from tests.tools import venv_installed

    return venv_installed("checkov", CHECKOV, timeout=1800) / "checkov"
