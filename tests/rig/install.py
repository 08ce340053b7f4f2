"""Putting kiln into the rig for a test: the CRD, a namespace of the test's own, the Helm chart rendered by the
rig's helm. Helpers the integration and e2e tests share (tests/support holds the rest)."""

from __future__ import annotations

import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import yaml

from kiln.api.spec import GROUP, PLURAL
from tests.rig import versions
from tests.support.ranks import SAFETY_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "manifests" / "crds" / "kiln.dev_trainingspecs.yaml"
CHART = REPO / "helm" / "kiln"
# Offline, helm assumes Kubernetes 1.20 and the chart's kubeVersion refuses it: render for the rig's.
KUBE = ("--kube-version", versions.KUBERNETES)


def install_crd(rig) -> None:
    """Apply the checked-in CRD (server side: it is large) and wait until it is served."""
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    rig.kubectl("wait", "--for=condition=Established", f"--timeout={SAFETY_TIMEOUT_S}s", f"crd/{PLURAL}.{GROUP}")


@contextmanager
def scratch_namespace(rig, prefix: str):
    """A namespace of the test's own, deleted (without waiting) afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    rig.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        rig.kubectl("delete", "namespace", name, "--wait=false", check=False)


def helm(rig, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(rig.bin / "helm"), "--kubeconfig", str(rig.kubeconfig), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(rig, *args: str, release: str = "kiln", namespace: str = "kiln-system") -> list[dict]:
    """`helm template` of the chart (CRDs included) with `args` (e.g. --set k=v): its objects."""
    out = helm(rig, "template", release, str(CHART), "--namespace", namespace, "--include-crds", *KUBE, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]
