"""Only kiln's controllers may make pods that carry a run's labels (the chart's runLabelPolicy), as the rig's
apiserver enforces it: a run's NetworkPolicies admit pods labelled kiln.dev/trainingspec=<run> (and select the
lighthouse's by kiln.dev/lighthouse), so a namespace user who could set those labels on a pod of their own would
be let in. Here a user with `edit` rights in the namespace (mallory) is refused a pod, a label patch, a
ReplicaSet, a Deployment and a PyTorchJob carrying them, as is any other controller's identity (the Job
controller); the identities the policy lists make them, and the real Deployment → ReplicaSet → pod chain of
the rig's controller-manager still makes a lighthouse's pod."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.rig.install import render, scratch_namespace
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig

POLICY = "ValidatingAdmissionPolicy"
TRAINING_OPERATOR = "system:serviceaccount:kubeflow:training-operator"
MALLORY = "mallory"


def pod(name: str, namespace: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}],
                     "nodeSelector": {"kiln.test/nowhere": "true"}}}  # never scheduled


def template(labels: dict) -> dict:
    return {"metadata": {"labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}],
                     "nodeSelector": {"kiln.test/nowhere": "true"}}}


def deployment(name: str, namespace: str, labels: dict, kind: str = "Deployment") -> dict:
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template(labels)}}


def create(rig, user: str, obj: dict) -> str:
    """The apiserver's refusal of creating `obj` as `user` ("" when it was made)."""
    proc = rig.kubectl("create", "-f", "-", as_user=user, check=False, input=json.dumps(obj))
    return "" if proc.returncode == 0 else proc.stderr


@pytest.fixture(scope="module")
def namespace(rig):
    """A namespace the policy binds, with `edit` for mallory and the identities the policy lists."""
    with scratch_namespace(rig, "kiln-labels") as ns:
        release = f"kiln-{uuid.uuid4().hex[:6]}"
        operator = f"system:serviceaccount:kiln-system:{release}-operator"
        # the rig's training-operator acts as the admin (tests/rig/cluster.py): listed as a pod maker here
        admin = json.loads(rig.kubectl("auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]["username"]
        values = ["--set", "runLabelPolicy.enabled=true", "--set", f"watchNamespaces={{{ns}}}",
                  "--set", f"runLabelPolicy.podCreators={{{TRAINING_OPERATOR},{admin},"
                           "system:serviceaccount:kube-system:replicaset-controller}"]
        objs = [o for o in render(rig, *values, release=release)
                if o["kind"].startswith("ValidatingAdmissionPolicy") and o["metadata"]["name"].endswith("-run-labels")]
        assert len(objs) == 2, [o["kind"] for o in objs]
        for user in (MALLORY, TRAINING_OPERATOR, operator, "system:serviceaccount:kube-system:job-controller"):
            rig.kubectl("create", "rolebinding", f"edit-{uuid.uuid4().hex[:6]}", "--clusterrole=edit",
                        f"--user={user}", "-n", ns)
        rig.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "jobs", "namespace": ns},
                   "rules": [{"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["create"]}]})
        rig.kubectl("create", "rolebinding", "jobs", "--role=jobs", f"--user={MALLORY}", "-n", ns)
        for obj in objs:
            rig.apply(obj)
        try:
            # the apiserver enforces a new policy once its informer has it: wait for the first refusal
            rig.wait_for("the run-label policy to refuse a forged pod", lambda: POLICY in create(
                rig, MALLORY, pod(f"probe-{uuid.uuid4().hex[:6]}", ns, {"kiln.dev/trainingspec": "victim"})),
                timeout=SAFETY_TIMEOUT_S)
            yield ns, operator
        finally:
            for obj in objs:
                rig.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)


def test_a_namespace_user_cannot_make_a_pod_that_carries_a_runs_labels(rig, namespace):
    ns, _ = namespace
    for labels in ({"kiln.dev/trainingspec": "victim"}, {"kiln.dev/lighthouse": "victim"}):
        why = create(rig, MALLORY, pod(f"forged-{uuid.uuid4().hex[:6]}", ns, labels))
        assert POLICY in why and "kiln run's labels" in why, why
    # nor another controller acting for them (a Job's, a StatefulSet's pods are made by their controllers)
    why = create(rig, "system:serviceaccount:kube-system:job-controller",
                 pod("job-made", ns, {"kiln.dev/trainingspec": "victim"}))
    assert POLICY in why, why
    # a pod of their own is fine; labelling it as the run's afterwards is not; other label changes are
    assert not create(rig, MALLORY, pod("plain", ns, {"app": "mine"}))
    relabel = rig.kubectl("label", "pod", "plain", "-n", ns, "kiln.dev/trainingspec=victim", as_user=MALLORY,
                          check=False)
    assert relabel.returncode != 0 and POLICY in relabel.stderr, relabel.stderr
    assert rig.kubectl("label", "pod", "plain", "-n", ns, "tier=2", as_user=MALLORY, check=False).returncode == 0
    # workloads whose pods would carry them
    for kind in ("Deployment", "ReplicaSet"):
        why = create(rig, MALLORY, deployment(f"forged-{kind.lower()}", ns, {"kiln.dev/lighthouse": "victim"}, kind))
        assert POLICY in why, (kind, why)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "forged", "namespace": ns},
           "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": template(
               {"kiln.dev/trainingspec": "victim"})}}}}
    why = create(rig, MALLORY, job)
    assert POLICY in why, why


def test_the_listed_identities_make_them_and_the_controllers_chain_still_makes_the_lighthouses_pod(rig, namespace):
    ns, operator = namespace
    assert not create(rig, TRAINING_OPERATOR, pod("victim-worker-0", ns, {"kiln.dev/trainingspec": "victim"}))
    # the operator's lighthouse Deployment; the rig's controller-manager makes its ReplicaSet and pod
    assert not create(rig, operator, deployment("victim-lighthouse", ns, {"kiln.dev/lighthouse": "victim"}))
    made = rig.wait_for("the lighthouse's pod made by the ReplicaSet controller", lambda: json.loads(rig.kubectl(
        "get", "pods", "-n", ns, "-l", "kiln.dev/lighthouse=victim", "-o", "json").stdout)["items"],
        timeout=SAFETY_TIMEOUT_S)
    assert made[0]["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
