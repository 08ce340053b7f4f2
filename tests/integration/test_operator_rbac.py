"""The operator's write rights, as the rig's apiserver enforces them on the operator's own identity.

The chart's RBAC and admission policy are applied for a release of this test's own; every request below is
made as the operator's ServiceAccount through impersonation (`Impersonate-User:
system:serviceaccount:<ns>:<release>-operator`, what `kubectl --as` sends). It can do every write a run
needs (the operator's own reconcile of a run with replica groups, a pod deleted, its Lease, an Event), and
cannot patch a Deployment, ConfigMap or RoleBinding it did not make, make a Role or RoleBinding beyond a
run's trainer pair, nor write anything in kube-system or in its own namespace but its Lease. Both installs:
namespaced (the default) and cluster-wide (the opt-in, where only the admission policy stands between the
token and kube-system).
"""

from __future__ import annotations

import base64
import json
import uuid

import pytest

from kiln.control import sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from tests.rig.install import install_crd, render, scratch_namespace
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
KILN = {"app.kubernetes.io/managed-by": "kiln"}


@pytest.fixture(scope="module", params=["namespaced", "cluster"])
def install(request, rig):
    """(operator namespace, runs namespace, the operator's user name, its Lease, the scope)."""
    install_crd(rig)
    with scratch_namespace(rig, "kiln-rbac-op") as home, scratch_namespace(rig, "kiln-rbac-runs") as runs:
        release = f"kiln-{uuid.uuid4().hex[:6]}"
        values = ("--set", "clusterWide=true") if request.param == "cluster" else ("--set", f"watchNamespaces={{{runs}}}")
        objs = [o for o in render(rig, *values, release=release, namespace=home)
                if o["kind"] in RBAC_KINDS and not o["metadata"]["name"].endswith("-trainer")]
        assert {o["kind"] for o in objs} >= {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
        for obj in objs:
            rig.apply(obj)
        user = f"system:serviceaccount:{home}:{release}-operator"
        try:
            # the apiserver starts enforcing a new policy once its informer has it: wait for the first refusal
            # (RBAC allows the create: the refusal, once it comes, is the policy's)
            rig.wait_for("the admission policy to refuse an unlabelled ConfigMap", lambda: "ValidatingAdmissionPolicy" in refused(
                rig, user, "create", "configmap", f"probe-{uuid.uuid4().hex[:6]}", "-n", runs), timeout=SAFETY_TIMEOUT_S)
            yield home, runs, user, f"{release}-operator", request.param
        finally:
            for obj in objs:
                if "namespace" not in obj["metadata"]:
                    rig.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)


def refused(rig, user: str, *args: str, stdin: str | None = None) -> str:
    """The apiserver's refusal of `kubectl --as=user args` ("" when it was allowed)."""
    proc = rig.kubectl(*args, as_user=user, check=False, input=stdin)
    if proc.returncode == 0:
        if args[0] == "create" and "configmap" in args:  # a probe that got through: not left behind
            rig.kubectl("delete", *args[1:], check=False)
        return ""
    assert "forbidden" in proc.stderr.lower() or "denied" in proc.stderr.lower(), proc.stderr
    return proc.stderr


def test_the_operator_can_make_and_run_a_run(rig, install):
    home, runs, user, lease, _ = install
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "wide", "namespace": runs},
            "spec": {"suspend": True, "model": {"preset": "tiny"}, "training": {"steps": 10, "globalBatchSize": 8},
                     "resources": {"nodes": 2, "gpusPerNode": 1, "gpuType": "NVIDIA-H200"},
                     "elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 2}}}}
    rig.apply(body)
    stored = json.loads(rig.kubectl("get", "trainingspec", "wide", "-n", runs, "-o", "json").stdout)
    api = api_client(str(rig.kubeconfig))
    api.set_default_header("Impersonate-User", user)  # every request below is the operator's
    events = []
    sync.reconcile(Kube(api), stored, OperatorConfig(), lambda b, e: events.append(e))
    status = json.loads(rig.kubectl("get", "trainingspec", "wide", "-n", runs, "-o", "json").stdout)["status"]
    accepted = next(c for c in status["conditions"] if c["type"] == "SpecAccepted")
    assert accepted["status"] == "True", accepted
    for kind, name in [("serviceaccount", "wide-trainer"), ("role", "wide-trainer"), ("rolebinding", "wide-trainer"),
                       ("networkpolicy", "wide-trainer"), ("configmap", "wide-spec"), ("deployment", "wide-lighthouse"),
                       ("service", "wide-lighthouse"), ("networkpolicy", "wide-lighthouse"),
                       ("pytorchjob", "wide-g0"), ("pytorchjob", "wide-g1"), ("secret", "wide-ft")]:
        assert rig.kubectl("get", kind, name, "-n", runs, check=False).returncode == 0, (kind, name)
    run_secret_is_the_runs_own(rig, runs, stored, user)

    # a run's pod (the training-operator makes them from kiln's template, labels included) may be deleted
    rig.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "wide-g0-worker-0", "namespace": runs, "labels": {**KILN, "kiln.dev/trainingspec": "wide"}},
        "spec": {"containers": [{"name": "pytorch", "image": "registry.invalid/none", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                 "nodeSelector": {"kiln.test/nowhere": "true"}}})  # never scheduled
    assert not refused(rig, user, "delete", "pod", "wide-g0-worker-0", "-n", runs, "--wait=false")
    # an Event about the run, and its Lease at home
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"wide.{uuid.uuid4().hex[:8]}", "namespace": runs},
             "involvedObject": {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "name": "wide",
                                "namespace": runs},
             "reason": "Test", "message": "m", "type": "Normal"}
    assert not refused(rig, user, "create", "-f", "-", stdin=json.dumps(event))
    lease_body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": lease, "namespace": home},
                  "spec": {"holderIdentity": "test"}}
    assert not refused(rig, user, "create", "-f", "-", stdin=json.dumps(lease_body))


def pod_templates(rig, namespace: str) -> dict[str, dict]:
    """Every pod template of the namespace's PyTorchJobs and Deployments (what their pods are made from)."""
    out = {}
    for kind in ("pytorchjobs", "deployments"):
        for obj in json.loads(rig.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]:
            specs = obj["spec"].get("pytorchReplicaSpecs", {"": obj["spec"]})
            out |= {f"{kind}/{obj['metadata']['name']}{role}": s["template"] for role, s in specs.items()}
    return out


def run_secret_is_the_runs_own(rig, namespace: str, run: dict, user: str) -> None:
    """The run's `<run>-ft` Secret: made by the operator's reconcile, owned by the run (deleted with it), 32 random
    bytes; only the run's own pod templates mount it; the operator cannot read it back."""
    name = run["metadata"]["name"]
    secret = json.loads(rig.kubectl("get", "secret", f"{name}-ft", "-n", namespace, "-o", "json").stdout)
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("TrainingSpec", name, run["metadata"]["uid"])
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kiln"
    assert len(bytes.fromhex(base64.b64decode(secret["data"]["secret"]).decode())) == 32
    for key, template in pod_templates(rig, namespace).items():
        mounted = {v["secret"]["secretName"] for v in template["spec"].get("volumes") or [] if "secret" in v}
        labels = template["metadata"]["labels"]
        ours = name in (labels.get("kiln.dev/trainingspec"), labels.get("kiln.dev/lighthouse"))
        assert (f"{name}-ft" in mounted) == ours, (key, mounted)
    for verb in ("get", "list", "watch", "patch", "delete"):
        answer = rig.kubectl("auth", "can-i", verb, "secrets", "-n", namespace, as_user=user, check=False).stdout
        assert answer.strip() == "no", verb


def test_the_operator_cannot_touch_what_it_did_not_make(rig, install):
    home, runs, user, _, scope = install
    policy = "ValidatingAdmissionPolicy"
    # someone else's objects in a namespace it serves
    rig.kubectl("create", "deployment", "web", "--image=registry.invalid/web", "-n", runs)
    rig.kubectl("create", "configmap", "settings", "--from-literal=a=b", "-n", runs)
    rig.kubectl("create", "rolebinding", "team", "--clusterrole=view", "--user=alice", "-n", runs)
    patch = ("--type", "merge", "-p", json.dumps({"metadata": {"labels": {"pwned": "1"}}}))
    def stopped(why: str, kind: str) -> bool:
        # a RoleBinding of a role whose rights the operator does not hold is refused by RBAC's escalation check
        # before admission runs; every other write reaches the admission policy
        return policy in why or (kind == "rolebinding" and "forbidden" in why and "rolebindings" in why)

    for kind, name in [("deployment", "web"), ("configmap", "settings"), ("rolebinding", "team")]:
        why = refused(rig, user, "patch", kind, name, "-n", runs, *patch)
        assert stopped(why, kind), (kind, why)
        # nor by labelling it as kiln's first
        label = ("--type", "merge", "-p", json.dumps({"metadata": {"labels": KILN}}))
        why = refused(rig, user, "patch", kind, name, "-n", runs, *label)
        assert stopped(why, kind), (kind, why)
        assert refused(rig, user, "delete", kind, name, "-n", runs), kind  # RBAC grants no delete of these

    # kiln-labelled, but beyond a run's trainer pair: the operator's own rights bound to someone, or a wider Role
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "grab", "namespace": runs, "labels": KILN},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": user.rsplit(":", 1)[1]},
               "subjects": [{"kind": "User", "name": "mallory"}]}
    assert policy in refused(rig, user, "create", "-f", "-", stdin=json.dumps(binding))
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "grab", "namespace": runs, "labels": KILN},
            "rules": [{"apiGroups": ["kiln.dev"], "resources": ["trainingspecs"], "verbs": ["get", "patch"]}]}
    assert policy in refused(rig, user, "create", "-f", "-", stdin=json.dumps(role))

    # a Secret only as a run's `<run>-ft`, owned by its TrainingSpec: not another name, not unowned
    for secret_name, owned in (("creds", True), ("wide-ft", False), ("other-ft", True)):
        meta = {"name": secret_name, "namespace": runs, "labels": KILN}
        if owned:
            meta["ownerReferences"] = [{"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "name": "wide",
                                        "uid": str(uuid.uuid4())}]
        why = refused(rig, user, "create", "-f", "-", stdin=json.dumps(
            {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"secret": "00" * 32}}))
        assert policy in why, (secret_name, why)

    # kube-system, even an object labelled as kiln's: RBAC refuses it in the namespaced install, the admission
    # policy in the cluster-wide one (where RBAC alone would let it through)
    bait = f"kiln-bait-{uuid.uuid4().hex[:6]}"
    rig.apply({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": bait, "namespace": "kube-system", "labels": KILN}, "data": {"a": "b"}})
    try:
        why = refused(rig, user, "patch", "configmap", bait, "-n", "kube-system", *patch)
        assert why and (policy in why if scope == "cluster" else True), why
        coredns_like = {"apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": "kiln-evil", "namespace": "kube-system", "labels": KILN},
                        "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                            "metadata": {"labels": {"a": "b"}},
                            "spec": {"containers": [{"name": "c", "image": "registry.invalid/evil"}]}}}}
        why = refused(rig, user, "create", "-f", "-", stdin=json.dumps(coredns_like))
        assert why and (policy in why if scope == "cluster" else True), why
    finally:
        rig.kubectl("delete", "configmap", bait, "-n", "kube-system", check=False)

    # its own namespace: only the Lease
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": home, "labels": KILN}}
    why = refused(rig, user, "create", "-f", "-", stdin=json.dumps(cm))
    assert why and (policy in why if scope == "cluster" else True), why

    # RBAC itself holds no verb that grants more than the operator holds, or acts as another
    for verb, resource in [("escalate", "roles"), ("bind", "clusterroles"), ("impersonate", "users"),
                           ("impersonate", "serviceaccounts"), ("get", "secrets")]:
        answer = rig.kubectl("auth", "can-i", verb, resource, "-n", runs, as_user=user, check=False).stdout.strip()
        assert answer == "no", (verb, resource)
