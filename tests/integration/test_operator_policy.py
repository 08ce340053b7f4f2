"""The admin policy on the rig's apiserver: a TrainingSpec that breaks it gets SpecAccepted=False with reason
ForbiddenByPolicy naming the field, and nothing is created; once fixed, the run's objects appear."""

from __future__ import annotations

import json

import pytest
import yaml

from kiln.control import sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.policy import AdminPolicy

from tests.rig.install import install_crd, scratch_namespace

pytestmark = pytest.mark.rig


@pytest.fixture
def ns(rig):
    with scratch_namespace(rig, "kiln-policy") as name:
        yield name


def spec(name: str, **resources) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny"}, "training": {"steps": 10, "globalBatchSize": 8},
                     "image": "registry.corp/ml/kiln-trainer:1",
                     "resources": {"nodes": 1, "gpusPerNode": 1, "gpuType": "NVIDIA-H200", **resources}}}


def test_a_spec_the_policy_forbids_is_refused_by_name_and_nothing_is_created(rig, ns):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))
    config = OperatorConfig(policy=AdminPolicy(allowed_image_prefixes=("registry.corp/ml/",)))
    events = []
    body = spec("greedy", tolerations=[{"operator": "Exists"}])
    rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))

    def current() -> dict:
        return json.loads(rig.kubectl("get", "trainingspec", "greedy", "-n", ns, "-o", "json").stdout)

    sync.reconcile(kube, current(), config, lambda b, e: events.append(e))
    accepted = next(c for c in current()["status"]["conditions"] if c["type"] == "SpecAccepted")
    assert accepted["status"] == "False" and accepted["reason"] == "ForbiddenByPolicy"
    assert "spec.resources.tolerations[0]" in accepted["message"]
    assert rig.kubectl("get", "pytorchjob", "greedy", "-n", ns, check=False).returncode != 0
    assert rig.kubectl("get", "configmap", "greedy-spec", "-n", ns, check=False).returncode != 0

    # the user names the taint: accepted, the run's objects appear
    rig.kubectl("patch", "trainingspec", "greedy", "-n", ns, "--type", "merge", "-p",
                json.dumps({"spec": {"resources": {"tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]}}}))
    sync.reconcile(kube, current(), config, lambda b, e: events.append(e))
    accepted = next(c for c in current()["status"]["conditions"] if c["type"] == "SpecAccepted")
    assert accepted["status"] == "True", accepted
    job = json.loads(rig.kubectl("get", "pytorchjob", "greedy", "-n", ns, "-o", "json").stdout)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] \
        == "registry.corp/ml/kiln-trainer:1"


HOSTNAME = "kubernetes.io/hostname"
STRICT = OperatorConfig(policy=AdminPolicy(allowed_image_prefixes=("registry.corp/ml",),
                                           allowed_queue_priorities=("normal",), max_nodes=8, max_gpus=8, max_groups=2))


@pytest.mark.parametrize("name,changes,field", [
    ("evil-image", {"image": "registry.corp/ml-evil/kiln-trainer:1"}, "spec.image"),
    ("by-host", {"resources": {"nodeSelector": {HOSTNAME: "control-plane-0"}}}, "spec.resources.nodeSelector"),
    ("by-field", {"resources": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                "values": ["control-plane-0"]}]}]}}}}}, "spec.resources.affinity"),
    ("near-system", {"resources": {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"k8s-app": "kube-dns"}}, "topologyKey": HOSTNAME,
         "namespaces": ["kube-system"]}]}}}}, "spec.resources.affinity.podAffinity"),
    ("cordoned", {"resources": {"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]}},
     "spec.resources.tolerations[0]"),
    ("urgent", {"scheduling": {"priority": "urgent"}}, "spec.scheduling.priority"),
    ("huge", {"resources": {"nodes": 16}, "training": {"steps": 10, "globalBatchSize": 16}}, "spec.resources.nodes"),
    ("many-gpus", {"resources": {"gpusPerNode": 16}, "training": {"steps": 10, "globalBatchSize": 16}},
     "spec.resources.gpusPerNode"),
    ("many-groups", {"resources": {"nodes": 4}, "elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 4}}},
     "spec.elastic.faultTolerance.groups"),
])
def test_each_new_rule_refuses_by_field_name_on_the_apiserver(rig, ns, name, changes, field):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))
    body = spec(name)
    for key, value in changes.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))  # the CRD's own rules accept it
    stored = json.loads(rig.kubectl("get", "trainingspec", name, "-n", ns, "-o", "json").stdout)
    sync.reconcile(kube, stored, STRICT, lambda b, e: None)
    status = json.loads(rig.kubectl("get", "trainingspec", name, "-n", ns, "-o", "json").stdout)["status"]
    accepted = next(c for c in status["conditions"] if c["type"] == "SpecAccepted")
    assert accepted["status"] == "False" and accepted["reason"] == "ForbiddenByPolicy", accepted
    assert accepted["message"].startswith(field), accepted["message"]
    assert rig.kubectl("get", "configmap", f"{name}-spec", "-n", ns, check=False).returncode != 0
