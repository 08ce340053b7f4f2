"""On the rig, as the kiln-operator ServiceAccount: a TrainingSpec named like someone else's object never
takes it over (issue 13, item 3), and an apply the apiserver refuses ends in a condition saying why
(item 8) instead of a silent retry."""

from __future__ import annotations

import pytest

from kiln.api.spec import GROUP, VERSION
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.sync import Wait, reconcile
from tests.rig.install import install_crd
from tests.support.operator import operator_kube  # noqa: F401 - fixtures

pytestmark = pytest.mark.rig


@pytest.fixture(params=["cluster"])
def scope(request) -> str:
    """operator_kube's RBAC here: the cluster-wide install."""
    return request.param


@pytest.fixture
def admin(rig) -> Kube:
    install_crd(rig)
    return Kube(api_client(str(rig.kubeconfig)))


def spec(namespace: str, name: str, **resources) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingSpec",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"image": "kiln-trainer:rig", "model": {"preset": "tiny"},
                     "resources": {"nodes": 1, **resources}, "checkpoint": {"uri": "file:///tmp/ckpt/"}}}


def accepted(kube: Kube, namespace: str, name: str) -> dict:
    conditions = (kube.trainingspec(namespace, name).get("status") or {}).get("conditions") or []
    return next(c for c in conditions if c["type"] == "SpecAccepted")


FOREIGN = {
    "ConfigMap": ("own-spec", lambda ns: {"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "own-spec", "namespace": ns},
                                          "data": {"team": "someone else's"}}),
    "ServiceAccount": ("own-trainer", lambda ns: {"apiVersion": "v1", "kind": "ServiceAccount",
                                                  "metadata": {"name": "own-trainer", "namespace": ns}}),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_someone_elses_object_is_reported_not_adopted(rig, namespace, admin, operator_kube, kind):  # noqa: F811
    obj_name, make = FOREIGN[kind]
    rig.apply(make(namespace))
    before = admin.read(make(namespace))
    rig.apply(spec(namespace, "own"))
    events = []
    post = lambda body, event: events.append(event)  # noqa: E731 - the handler posts Events via kopf
    config = OperatorConfig(image="kiln-trainer:rig")

    with pytest.raises(Wait):  # retried later: the object may go away
        reconcile(operator_kube, admin.trainingspec(namespace, "own"), config, post)
    cond = accepted(admin, namespace, "own")
    assert cond["status"] == "False" and cond["reason"] == "NotOwner"
    assert f"{kind} {namespace}/{obj_name} exists and is not this run's" in cond["message"]
    assert [e.reason for e in events if e.type == "Warning"] == ["NotOwner"]
    after = admin.read(make(namespace))
    assert not after["metadata"].get("ownerReferences") and after.get("data") == before.get("data")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # not touched at all
    assert admin.job(namespace, "own") is None  # nothing runs as (or mounts) someone else's object

    rig.kubectl("delete", kind.lower(), obj_name, "-n", namespace)
    body = admin.trainingspec(namespace, "own")
    assert reconcile(operator_kube, body, config, post).endswith("Applied")
    ours = admin.read(make(namespace))
    assert [o["uid"] for o in ours["metadata"]["ownerReferences"]] == [body["metadata"]["uid"]]
    assert admin.job(namespace, "own") is not None


def test_an_apply_the_apiserver_refuses_ends_in_a_condition(rig, namespace, admin, operator_kube):  # noqa: F811
    # affinity is passed through unchecked by kiln; the PyTorchJob's schema refuses this one
    bad = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "any"}}}
    rig.apply(spec(namespace, "refused", affinity=bad))
    events = []
    summary = reconcile(operator_kube, admin.trainingspec(namespace, "refused"),
                        OperatorConfig(image="kiln-trainer:rig"), lambda body, event: events.append(event))
    assert summary.endswith("ApplyRefused")  # no retry: only a new spec can help, and it reconciles again
    cond = accepted(admin, namespace, "refused")
    assert cond["status"] == "False" and cond["reason"] == "ApplyRefused"
    assert f"applying PyTorchJob {namespace}/refused failed" in cond["message"]
    assert "nodeSelectorTerms" in cond["message"]
    assert [e.reason for e in events if e.type == "Warning"] == ["ApplyRefused"]


def test_a_read_the_apiserver_refuses_ends_in_read_failed_and_the_retry_applies(rig, namespace, admin,  # noqa: F811
                                                                                operator_kube):
    # A real refusal: an identity that may write the run's status but not read its PyTorchJob (403 on the
    # reconcile's first read). Nothing is known of the run's objects, so only SpecAccepted says why.
    rig.apply([{"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "status-only", "namespace": namespace}},
               {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "status-only", "namespace": namespace},
                "rules": [{"apiGroups": [GROUP], "resources": ["trainingspecs/status"], "verbs": ["patch"]}]},
               {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "status-only", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "status-only"},
                "subjects": [{"kind": "ServiceAccount", "name": "status-only", "namespace": namespace}]}])
    status_only = Kube(api_client(str(rig.kubeconfig_for_service_account(namespace, "status-only"))))
    rig.apply(spec(namespace, "unread"))
    events = []
    post = lambda body, event: events.append(event)  # noqa: E731
    config = OperatorConfig(image="kiln-trainer:rig")
    # RBAC reaches the apiserver's authorizer through its cache: wait until the Role binds (progress, not time)
    rig.wait_for("the status-only Role in force", lambda: rig.kubectl(
        "auth", "can-i", "patch", f"trainingspecs.{GROUP}", "--subresource=status", "-n", namespace,
        f"--as=system:serviceaccount:{namespace}:status-only", check=False).stdout.strip() == "yes")

    with pytest.raises(Wait):  # retried with a backoff: the read may work next time
        reconcile(status_only, admin.trainingspec(namespace, "unread"), config, post)
    cond = accepted(admin, namespace, "unread")
    assert cond["status"] == "False" and cond["reason"] == "ReadFailed"
    assert cond["message"].startswith(f"reading the objects of {namespace}/unread failed (403)")
    assert "pytorchjobs" in cond["message"]  # the apiserver's own words name what could not be read
    assert [e.reason for e in events if e.type == "Warning"] == ["ReadFailed"]
    assert admin.job(namespace, "unread") is None  # nothing applied on guesswork

    # the retry, as an operator that may read: the run is applied and the condition says so
    assert reconcile(operator_kube, admin.trainingspec(namespace, "unread"), config, post).endswith("Applied")
    assert accepted(admin, namespace, "unread")["reason"] == "Applied"
    assert admin.job(namespace, "unread") is not None
