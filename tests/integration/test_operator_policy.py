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

from tests.integration.test_operator_api import install_crd
from tests.integration.test_operator_lifecycle import scratch_namespace

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
