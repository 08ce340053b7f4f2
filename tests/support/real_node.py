"""The rig's real node for end-to-end tests: both images loaded into its containerd, kiln installed by its Helm
chart, a namespace under Pod Security `restricted` for the runs, CPU runs that train in real pods, and reading
what they did (status, pods, logs, a diagnosis when they do not get there)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.rig import images as rig_images
from tests.support.operator import get, status
from tests.support.specs import MICRO_MODEL


REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kiln"
RELEASE = "kiln-e2e"
SECRET = "s3-credentials"


# Two pods of one process each; small enough that two of them and the operator fit on a 2-core node.


POD_RESOURCES = {"cpu": "600m", "memory": "2Gi"}
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


START_TIMEOUT = 900  # pods start, import torch and rendezvous: slow on a loaded 2-core machine


@pytest.fixture(scope="module")
def loaded_images(real_node) -> dict[str, str]:
    """Both images built from their Dockerfiles (cached) and loaded into the node's containerd."""
    return rig_images.load_into_node(real_node)  # re-imported whenever the sources changed


def restricted_namespace(rig, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    rig.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": RESTRICTED}})
    return name


@pytest.fixture(scope="module")
def runs_ns(rig):
    """Where the TrainingSpecs live: Pod Security `restricted` enforced, the S3 credentials as a Secret."""
    name = restricted_namespace(rig, "kiln-e2e-runs")
    rig.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": name},
               "stringData": {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}})
    yield name
    rig.kubectl("delete", "namespace", name, "--wait=false", check=False)


def helm(rig, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(rig.bin / "helm"), *args, "--kubeconfig", str(rig.kubeconfig)],
                          capture_output=True, text=True, timeout=600)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def operator_release(rig, real_node, loaded_images, runs_ns):
    """`helm install` of the chart, watching the runs' namespace, its pod pinned to the real node."""
    ns = restricted_namespace(rig, "kiln-e2e-system")
    release = f"{RELEASE}-{ns.rsplit('-', 1)[1]}"  # its cluster-wide RBAC is named after it: one per session
    node_selector_key = next(iter(real_node.node_selector))
    tol = real_node.toleration
    try:
        yield from _installed(rig, release, ns, node_selector_key, tol, real_node, runs_ns)
    finally:
        helm(rig, "uninstall", release, "--namespace", ns, "--wait", check=False)
        rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _installed(rig, release, ns, node_selector_key, tol, real_node, runs_ns):
    proc = helm(rig, "install", release, str(CHART), "--namespace", ns, "--wait", "--timeout", f"{START_TIMEOUT}s",
         "--set", f"watchNamespaces={{{runs_ns}}}",
         "--set-string", f"operator.nodeSelector.{node_selector_key.replace('.', chr(92) + '.')}"
                         f"={real_node.node_selector[node_selector_key]}",
         "--set", f"operator.tolerations[0].key={tol['key']}",
         "--set", f"operator.tolerations[0].operator={tol.get('operator', 'Equal')}",
         "--set-string", f"operator.tolerations[0].value={tol.get('value', '')}",
         "--set", f"operator.tolerations[0].effect={tol['effect']}", check=False)
    if proc.returncode != 0:
        pod_logs = rig.kubectl("logs", "-n", ns, "-l", "app.kubernetes.io/component=operator", "--tail=40",
                               check=False)
        raise AssertionError(f"helm install failed: {proc.stderr}\n"
                             f"{rig.kubectl('get', 'pods', '-n', ns, '-o', 'wide', check=False).stdout}\n"
                             f"{pod_logs.stdout}{pod_logs.stderr}")
    yield ns


def kiln(*args: str, rig, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """The `kiln` command as a user runs it, with the rig's kubeconfig and S3 credentials."""
    env = {**rig.env, "AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def pods(rig, ns: str, run: str) -> list[dict]:
    out = rig.kubectl("get", "pods", "-n", ns, "-l", f"kiln.dev/trainingspec={run}", "-o", "json").stdout
    return json.loads(out)["items"]


def diagnose(rig, ns: str, run: str) -> str:
    """What a user would look at when a run is stuck: its status, pods, events and the pods' logs."""
    parts = [json.dumps(status(rig, ns, run), indent=1)[-2000:],
             rig.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout,
             rig.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]]
    for pod in pods(rig, ns, run):
        parts.append(rig.kubectl("logs", "-n", ns, pod["metadata"]["name"], "--tail=30", check=False).stdout)
    return "\n".join(parts)


def wait_status(rig, ns: str, run: str, what: str, predicate, timeout: float = START_TIMEOUT) -> dict:
    """Wait until the run's status satisfies `predicate` (a safety-net timeout, not a trigger)."""
    try:
        return rig.wait_for(f"{run}: {what}", lambda: (s := status(rig, ns, run)) and predicate(s) and s,
                            timeout=timeout, interval=1)
    except Exception as err:  # noqa: BLE001 - re-raised with what a user would look at
        raise AssertionError(f"{err}\n{diagnose(rig, ns, run)}") from None


def committed(step: int):
    return lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= step


def cpu_run(rig, real_node, ns: str, name: str, *, steps: int, interval: int, schedule: str = "constant") -> dict:
    """Two pods × one process on the real node, gloo, checkpoints to the rig's S3 as the pods reach it."""
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": MICRO_MODEL,
            "data": {"uri": "builtin:pydoc"},
            "training": {"steps": steps, "globalBatchSize": 8, "microBatchSize": 4, "lr": 3e-3,
                         "warmupSteps": 0, "schedule": schedule, "precision": "fp32", "logEvery": 1},
            "parallelism": {"fsdp": True, "compile": False},
            "resources": {"nodes": 2, "processesPerNode": 1, **POD_RESOURCES,
                          "nodeSelector": real_node.node_selector, "tolerations": [real_node.toleration]},
            "elastic": {"maxRestarts": 5},
            "checkpoint": {"uri": f"s3://{rig.s3_bucket}/e2e/{ns}/{name}/",
                           "endpoint": f"http://{rig.bridge_ip}:{rig.s3_endpoint.rsplit(':', 1)[1]}",
                           "credentialsSecret": SECRET, "intervalSteps": interval, "keep": 5},
        },
    }


def apply(rig, body: dict) -> None:
    rig.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def logged_steps(log: str) -> list[int]:
    """The steps of the trainer's progress lines ("step N/TOTAL  loss …") in a rank-0 log."""
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+)/\d+", log, re.MULTILINE)]


def eval_loss(rig, spec_path: Path, checkpoint: str | None = None) -> dict:
    out = spec_path.parent / f"eval-{uuid.uuid4().hex[:6]}.json"
    args = ["eval", str(spec_path), "--endpoint", rig.s3_endpoint, "--json", str(out)]
    if checkpoint:
        args += ["--checkpoint", checkpoint]
    kiln(*args, rig=rig)
    return json.loads(out.read_text())
