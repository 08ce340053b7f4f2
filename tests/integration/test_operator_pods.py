"""spec.pod on the rig's apiserver, the oracle for what kiln renders: it accepts the rendered trainer pods,
its Pod Security admission agrees with kiln.control.pods.security_level (the pod passes at the level kiln
names and fails one level stricter), the CRD refuses kiln's own env names, and the operator's policy refuses
a hostPath outside its prefixes by field with nothing created."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import pytest
import yaml

from kiln.api.load import parse
from kiln.control import pods, sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.plan import plan
from tests.pod_settings import EVERYTHING, OPEN
from tests.rig.install import install_crd, scratch_namespace

pytestmark = pytest.mark.rig

LEVELS = ("restricted", "baseline", "privileged")


RUNTIME_CLASS = f"kiln-pss-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def level_namespaces(rig):
    """One namespace per Pod Security level, enforced, each with the ServiceAccounts the pods name (admission
    refuses a pod whose ServiceAccount does not exist), and a RuntimeClass of this module's own."""
    names = {level: f"kiln-pss-{level}-{uuid.uuid4().hex[:6]}" for level in LEVELS}
    rig.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}}
        for level, ns in names.items()])
    rig.apply([{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}}
               for ns in names.values() for sa in ("pss-trainer", EVERYTHING["serviceAccountName"])]
              + [{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS},
                  "handler": "runc"}])
    yield names
    for ns in names.values():
        rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    rig.kubectl("delete", "runtimeclass", RUNTIME_CLASS, "--wait=false", check=False)


def spec(pod: dict | None = None, network: dict | None = None) -> dict:
    if pod and "runtimeClassName" in pod:
        pod = {**pod, "runtimeClassName": RUNTIME_CLASS}
    body = {"model": {"preset": "tiny"}, "training": {"steps": 10, "globalBatchSize": 8},
            "resources": {"nodes": 1, "gpusPerNode": 1}}
    body |= {"pod": pod} if pod else {}
    body |= {"network": network} if network else {}
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "pss"}, "spec": body}


def rendered_pod(raw: dict, namespace: str) -> dict:
    doc = parse({**raw, "metadata": {"name": "pss", "namespace": namespace}})
    # CHOWN: a capability Pod Security baseline allows (the baseline case below); the open policy lists IPC_LOCK
    policy = replace(OPEN, allowed_capabilities=(*OPEN.allowed_capabilities, "CHOWN"))
    result = plan(doc, None, OperatorConfig(image="registry.test/trainer:1", policy=policy))
    assert result.refused is None, result.refused
    job = next(o for o in result.objects if o["kind"] == "PyTorchJob")
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pss-{uuid.uuid4().hex[:6]}",
                                                            "namespace": namespace},
            "spec": {**template["spec"], "restartPolicy": "Never"}}


def server_dry_run(rig, pod: dict):
    return rig.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)


@pytest.mark.parametrize("pod_settings, network, level", [
    (None, None, "restricted"),
    ({"volumes": [v for v in EVERYTHING["volumes"] if "hostPath" not in v], "env": EVERYTHING["env"],
      "shmSize": "1Gi", "imagePullSecrets": [{"name": "regcred"}],
      "extraResources": [{"name": "rdma/ib", "quantity": "1"}]},
     {"fabric": "efa", "devices": 4}, "restricted"),
    ({"capabilities": ["CHOWN"]}, None, "baseline"),
    (None, {"fabric": "infiniband"}, "privileged"),  # IPC_LOCK
    ({"volumes": [v for v in EVERYTHING["volumes"] if "hostPath" in v]}, None, "privileged"),
    ({"hostNetwork": True}, None, "privileged"),
    (EVERYTHING, None, "privileged"),
])


def test_the_apiservers_pod_security_admits_the_pod_at_kilns_level_and_not_stricter(
        rig, level_namespaces, pod_settings, network, level):
    raw = spec(pod_settings, network)
    assert pods.security_level(parse(raw).spec)[0] == level
    ok = server_dry_run(rig, rendered_pod(raw, level_namespaces[level]))
    assert ok.returncode == 0, ok.stderr  # valid, and allowed at that level
    if level != "restricted":
        stricter = LEVELS[LEVELS.index(level) - 1]
        refused = server_dry_run(rig, rendered_pod(raw, level_namespaces[stricter]))
        assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


@pytest.fixture
def ns(rig):
    with scratch_namespace(rig, "kiln-pods") as name:
        yield name


def test_the_crd_refuses_kilns_own_env_names_and_a_volume_without_one_source(rig, ns):
    install_crd(rig)
    for pod, says in (({"env": [{"name": "PET_NNODES", "value": "9"}]}, "pod.env may not set a variable kiln sets"),
                      ({"volumes": [{"name": "x", "mountPath": "/x"}]}, "a volume sets exactly one of")):
        proc = rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(spec(pod)), check=False)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr


def test_a_host_path_outside_the_policy_is_refused_by_field_and_nothing_is_created(rig, ns):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))
    body = spec({"volumes": [{"name": "etc", "mountPath": "/host-etc", "hostPath": {"path": "/etc"}}]})
    rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
    current = json.loads(rig.kubectl("get", "trainingspec", "pss", "-n", ns, "-o", "json").stdout)
    sync.reconcile(kube, current, OperatorConfig(), lambda b, e: None)  # the default policy: no hostPath
    current = json.loads(rig.kubectl("get", "trainingspec", "pss", "-n", ns, "-o", "json").stdout)
    accepted = next(c for c in current["status"]["conditions"] if c["type"] == "SpecAccepted")
    assert accepted["status"] == "False" and accepted["reason"] == "ForbiddenByPolicy"
    assert accepted["message"].startswith("spec.pod.volumes[0].hostPath.path: '/etc'"), accepted
    assert rig.kubectl("get", "pytorchjob", "pss", "-n", ns, check=False).returncode != 0
    assert rig.kubectl("get", "configmap", "pss-spec", "-n", ns, check=False).returncode != 0
