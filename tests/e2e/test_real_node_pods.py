"""spec.pod for real on the rig's real node: one run whose pod gets an env var (plain and from a Secret), a PVC
bound to a hostPath-backed PV, a configMap volume, a larger /dev/shm and an image pull secret, in a namespace
that enforces Pod Security `restricted`. What the trainer's container sees is read from inside it (`kubectl
exec` of the image's own python, once the trainer reports its first step: the settings are the container's
as the kubelet ran it), and the pod's spec as the kubelet ran it shows the pull secret.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.real_node import (  # noqa: F401 - fixtures
    apply, cpu_run, diagnose, loaded_images, operator_release, pods, runs_ns, wait_status,
)

pytestmark = [pytest.mark.rig, pytest.mark.slow]

SHM = "256Mi"  # larger than a container's own 64Mi, and not the default (the 2Gi memory limit): pod.shmSize's

# What the container reports, with the image's own python: nothing in kiln's product code is for this test.
PROBE = """
import json, os
shm = os.statvfs("/dev/shm")
print(json.dumps({"greeting": os.environ.get("SITE_GREETING"), "token": os.environ.get("SITE_TOKEN"),
                  "motd": open("/etc/site/motd").read(), "marker": open("/cache/marker").read(),
                  "shm_bytes": shm.f_blocks * shm.f_frsize}))
"""


@pytest.fixture
def host_folder():
    """A folder of the node (this machine: the real node's kubelet runs here) holding a marker file, readable
    by the trainer's non-root user; the PV below is backed by it."""
    folder = Path(tempfile.mkdtemp(prefix="kiln-e2e-pv-", dir="/tmp"))
    os.chmod(folder, 0o755)
    (folder / "marker").write_text("from the PV\n")
    os.chmod(folder / "marker", 0o644)
    yield folder
    for child in folder.iterdir():
        child.unlink()
    folder.rmdir()


def test_a_run_with_site_pod_settings_starts_under_restricted_and_its_trainer_sees_each(
        rig, real_node, operator_release, runs_ns, host_folder):
    name, suffix = "e2e-pod", uuid.uuid4().hex[:6]
    pv, claim = f"kiln-e2e-pv-{suffix}", "hf-cache"
    docker_config = base64.b64encode(json.dumps({"auths": {"registry.invalid": {"auth": "dTpw"}}}).encode()).decode()
    apply(rig, {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(host_folder), "type": "Directory"},
                  "claimRef": {"namespace": runs_ns, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": runs_ns},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "site", "namespace": runs_ns},
         "data": {"motd": "hello from the site\n"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "site-token", "namespace": runs_ns},
         "stringData": {"token": "s3cr3t"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "regcred", "namespace": runs_ns},
         "type": "kubernetes.io/dockerconfigjson", "data": {".dockerconfigjson": docker_config}},
    ]})
    body = cpu_run(rig, real_node, runs_ns, name, steps=100000, interval=100000)  # runs until deleted
    body["spec"]["resources"]["nodes"] = 1
    body["spec"]["pod"] = {
        "env": [{"name": "SITE_GREETING", "value": "hi"},
                {"name": "SITE_TOKEN", "valueFrom": {"secretKeyRef": {"name": "site-token", "key": "token"}}}],
        "volumes": [{"name": "cache", "mountPath": "/cache", "readOnly": True,
                     "persistentVolumeClaim": {"claimName": claim}},
                    {"name": "site", "mountPath": "/etc/site", "configMap": {"name": "site"}}],
        "shmSize": SHM,
        "imagePullSecrets": [{"name": "regcred"}],
    }
    try:
        apply(rig, body)
        wait_status(rig, runs_ns, name, "the trainer stepping", lambda s: s.get("step", 0) >= 1)
        (pod,) = [p for p in pods(rig, runs_ns, name) if p["status"].get("phase") == "Running"]
        # the pod as the kubelet ran it: on the real node, with the pull secret, in the restricted namespace
        assert pod["spec"]["nodeName"] == real_node.name
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        accepted = next(c for c in wait_status(rig, runs_ns, name, "accepted", lambda s: s.get("conditions"))
                        ["conditions"] if c["type"] == "SpecAccepted")
        assert accepted["status"] == "True" and "Pod Security" not in accepted["message"]  # stays restricted
        seen = rig.kubectl("exec", "-n", runs_ns, pod["metadata"]["name"], "-c", "pytorch", "--",
                           "python", "-c", PROBE, check=False)
        assert seen.returncode == 0, seen.stderr + diagnose(rig, runs_ns, name)
        got = json.loads(seen.stdout.strip().splitlines()[-1])
        assert got["greeting"] == "hi" and got["token"] == "s3cr3t"
        assert got["motd"] == "hello from the site\n" and got["marker"] == "from the PV\n"
        assert got["shm_bytes"] == 256 * 2**20, got  # tmpfs sized by pod.shmSize
    finally:
        rig.kubectl("delete", "trainingspec", name, "-n", runs_ns, "--wait=true", "--timeout=120s", check=False)
        rig.kubectl("delete", "pvc", claim, "-n", runs_ns, "--wait=false", check=False)
        rig.kubectl("delete", "pv", pv, "--wait=false", check=False)
