"""The operator keeps what it made, acts alone, and retries what fails, on the rig (issue 13, items 6-8).

- Periodic resync: a run's ConfigMap, ServiceAccount, Role, RoleBinding, NetworkPolicy and PyTorchJob, deleted or changed
  by someone else, come back as kiln made them (the PyTorchJob at once, from its watch; the others at the
  next resync, every tick here: KILN_RESYNC_SECONDS=1).
- Backoff: a reconcile that cannot proceed says why in SpecAccepted and is retried with a growing delay.
- Leader election: of two operators on one Lease only the holder reconciles; when it stops (SIGTERM) or
  dies (SIGKILL) the other takes over within a bounded time.

Both operators run as the cluster-wide ServiceAccount of manifests/rbac (tests/integration/
test_operator_lifecycle.py::shipped_rbac); the test observes with the rig's admin credentials.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime

import pytest
import yaml

from tests.rig.install import install_crd, scratch_namespace
from tests.support.operator import Operator, condition, events, get, shipped_rbac, status, submit, wait_phase
from tests.support.ranks import SAFETY_TIMEOUT_S, free_port
from tests.support.specs import small_run

pytestmark = pytest.mark.rig

SETTINGS = {"KILN_RESYNC_SECONDS": "1"}


@pytest.fixture(scope="module")
def ns(rig):
    with scratch_namespace(rig, "kiln-ha") as name:
        yield name


@pytest.fixture(scope="module")
def cluster(rig, ns, tmp_path_factory):
    """(kubeconfig, Lease) of the operator ServiceAccount in `ns`."""
    install_crd(rig)
    with shipped_rbac(rig, ns, "cluster") as (sa, lease):
        yield rig.kubeconfig_for_service_account(ns, sa), f"{ns}/{lease}", tmp_path_factory.mktemp("operators")


def new_operator(ns: str, cluster, who: str) -> Operator:
    kubeconfig, lease, logs = cluster
    return Operator(kubeconfig, ns, logs / f"{who}.log", lease=lease, env={**SETTINGS, "POD_ID": who})


@pytest.fixture(scope="module")
def op_a(ns, cluster):
    op = new_operator(ns, cluster, "op-a")
    op.start()
    yield op
    op.stop()
    print(f"--- op-a log (tail) ---\n{op.tail()}")


def holder(rig, ns: str) -> str | None:
    lease = get(rig, ns, "lease", "kiln-operator")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


# ---- periodic resync: every object of a run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def drift_run(rig, ns, op_a) -> str:
    name = "drift"
    submit(rig, ns, small_run(name, suspend=True))  # no pods, no GPU: only the objects matter here
    wait_phase(rig, ns, name, "Suspended")
    rig.wait_for("SpecAccepted", lambda: condition(rig, ns, name, "SpecAccepted").get("status") == "True",
                 timeout=SAFETY_TIMEOUT_S)
    return name


def _tamper_spec_yaml(cm: dict) -> dict:
    doc = yaml.safe_load(cm["data"]["spec.yaml"])
    doc["spec"]["training"]["steps"] = 7  # a field the job could absorb: not an immutable change
    return {"data": {"spec.yaml": yaml.safe_dump(doc)}}


# kind, name suffix, what someone does (None: delete it), what must come back
DRIFT = {
    "pytorchjob-deleted": ("pytorchjob", "", None, lambda o: o["spec"]),
    "configmap-deleted": ("configmap", "-spec", None, lambda o: o["data"]),
    "configmap-edited": ("configmap", "-spec", _tamper_spec_yaml, lambda o: o["data"]),
    "serviceaccount-deleted": ("serviceaccount", "-trainer", None, lambda o: o["metadata"]["ownerReferences"]),
    "role-widened": ("role", "-trainer", lambda o: {"rules": o["rules"] + [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]}, lambda o: o["rules"]),
    "rolebinding-deleted": ("rolebinding", "-trainer", None, lambda o: (o["roleRef"], o["subjects"])),
    "networkpolicy-opened": ("networkpolicy", "-trainer", lambda o: {"spec": {"ingress": [{}]}},
                             lambda o: o["spec"]),
}


@pytest.mark.parametrize("case", list(DRIFT))
def test_what_someone_else_deletes_or_changes_comes_back(rig, ns, drift_run, case):
    kind, suffix, change, content = DRIFT[case]
    obj_name = drift_run + suffix
    before = get(rig, ns, kind, obj_name)
    t0 = time.monotonic()
    if change is None:
        rig.kubectl("delete", kind, obj_name, "-n", ns)

        def back():
            now = get(rig, ns, kind, obj_name)
            return now is not None and now["metadata"]["uid"] != before["metadata"]["uid"] and now
    else:
        rig.kubectl("patch", kind, obj_name, "-n", ns, "--type", "merge", "-p", json.dumps(change(before)))
        assert content(get(rig, ns, kind, obj_name)) != content(before)

        def back():
            now = get(rig, ns, kind, obj_name)
            return now is not None and content(now) == content(before) and now
    after = rig.wait_for(f"{kind}/{obj_name} as kiln made it", back, timeout=SAFETY_TIMEOUT_S)
    print(f"{case}: repaired after {time.monotonic() - t0:.1f}s")
    assert content(after) == content(before)
    assert after["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
    assert status(rig, ns, drift_run)["phase"] == "Suspended"


def test_a_resync_with_nothing_to_repair_writes_nothing(rig, ns, drift_run, op_a):
    # Every resync applies each object again; what matches what is stored is no write (no resourceVersion).
    kinds = [("pytorchjob", ""), ("configmap", "-spec"), ("serviceaccount", "-trainer"), ("role", "-trainer"),
             ("rolebinding", "-trainer"), ("networkpolicy", "-trainer")]
    versions = {k: get(rig, ns, k, drift_run + s)["metadata"]["resourceVersion"] for k, s in kinds}
    runs = len(json.loads(rig.kubectl("get", "trainingspecs", "-n", ns, "-o", "json").stdout)["items"])
    done = op_a.reconciles("resync")  # counted over all runs; each one's tick comes every 15 s in turn
    rig.wait_for("two more resyncs of every run", lambda: op_a.reconciles("resync") >= done + 2 * runs,
                 timeout=SAFETY_TIMEOUT_S)
    assert {k: get(rig, ns, k, drift_run + s)["metadata"]["resourceVersion"] for k, s in kinds} == versions


# ---- backoff -------------------------------------------------------------------------------------------------

KOPF_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\]")


def _retries(log: str, run: str) -> list[tuple[float, int, float]]:
    """(time, retry number, announced delay) of each temporary failure of `run`'s reconcile in kopf's log."""
    out = []
    for line in log.splitlines():
        m = re.search(r"retry (\d+) in (\d+)s", line)
        t = KOPF_TIME.match(line)
        if m and t and f"failed temporarily: {run}: " in line:
            out.append((datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m.group(1)),
                        float(m.group(2))))
    return out


def test_a_blocked_reconcile_says_why_and_retries_with_growing_delays(rig, ns, op_a):
    name = "blocked"
    rig.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-spec", "namespace": ns},
               "data": {"team": "someone else's"}})
    submit(rig, ns, small_run(name))
    cond = rig.wait_for("NotOwner", lambda: (c := condition(rig, ns, name, "SpecAccepted")).get("reason")
                        == "NotOwner" and c, timeout=SAFETY_TIMEOUT_S)
    assert f"ConfigMap {ns}/{name}-spec exists" in cond["message"]
    retries = rig.wait_for("three retries", lambda: len(r := _retries(op_a.log_since_start(), f"{ns}/{name}")) >= 3
                           and r, timeout=SAFETY_TIMEOUT_S)
    assert [(n, d) for _, n, d in retries[:3]] == [(1, 5.0), (2, 10.0), (3, 20.0)]
    gaps = [b[0] - a[0] for a, b in zip(retries, retries[1:3])]
    # each attempt came no earlier than the delay announced before it
    assert gaps[0] >= 5.0 - 0.5 and gaps[1] >= 10.0 - 0.5 and gaps[1] > gaps[0], gaps
    assert get(rig, ns, "pytorchjob", name) is None
    rig.kubectl("delete", "configmap", f"{name}-spec", "-n", ns)
    rig.wait_for("the job once the ConfigMap is gone", lambda: get(rig, ns, "pytorchjob", name),
                 timeout=SAFETY_TIMEOUT_S)


# ---- leader election -----------------------------------------------------------------------------------------


def test_only_the_leader_acts_and_the_other_takes_over(rig, ns, cluster, op_a):
    rig.wait_for("op-a holds the Lease", lambda: holder(rig, ns) == "op-a", timeout=SAFETY_TIMEOUT_S)
    op_b = new_operator(ns, cluster, "op-b")
    op_b.start()  # answers /healthz as a standby
    try:
        rig.wait_for("op-b waits", lambda: "standby" in op_b.log_since_start(), timeout=SAFETY_TIMEOUT_S)
        submit(rig, ns, small_run("first", suspend=True))
        wait_phase(rig, ns, "first", "Suspended")
        rig.wait_for("op-a's reconcile", lambda: f"{ns}/first: Applied" in op_a.log_since_start(),
                     timeout=SAFETY_TIMEOUT_S)
        assert holder(rig, ns) == "op-a"
        assert "first" not in op_b.log_since_start()  # the standby handled nothing
        assert [e["reason"] for e in events(rig, ns, "first")].count("Suspended") == 1

        # a clean stop releases the Lease: op-b leads within its retry period
        t0 = time.monotonic()
        op_a.stop()
        rig.wait_for("op-b holds the Lease", lambda: holder(rig, ns) == "op-b", timeout=SAFETY_TIMEOUT_S)
        handover = time.monotonic() - t0
        submit(rig, ns, small_run("second", suspend=True))
        wait_phase(rig, ns, "second", "Suspended")
        assert f"{ns}/second: Applied" in op_b.log_since_start()

        # a crash leaves the Lease held: op-a (a standby again) takes it once it was not renewed for its 15 s
        op_a.start()
        rig.wait_for("op-a waits", lambda: "standby" in op_a.log_since_start(), timeout=SAFETY_TIMEOUT_S)
        t1 = time.monotonic()
        op_b.stop(signal.SIGKILL)
        rig.wait_for("op-a holds the Lease", lambda: holder(rig, ns) == "op-a", timeout=SAFETY_TIMEOUT_S)
        takeover = time.monotonic() - t1
        submit(rig, ns, small_run("third", suspend=True))
        wait_phase(rig, ns, "third", "Suspended")
        assert f"{ns}/third: Applied" in op_a.log_since_start()
        print(f"leader handover after SIGTERM: {handover:.1f}s; takeover after SIGKILL: {takeover:.1f}s")
        assert handover < 10, handover  # retry period 2 s, plus process stop
        assert 15 <= takeover < 30, takeover  # Lease duration 15 s + retry period 2 s (+ the watch's start)
    finally:
        op_b.stop()
        print(f"--- op-b log (tail) ---\n{op_b.tail()}")


def test_an_operator_whose_lease_namespace_does_not_exist_names_it_and_exits(rig):
    """`kiln operator` out of cluster with one's own kubeconfig on a cluster without the Lease's namespace (issue
    28): the apiserver refuses the Lease (404); the operator names the namespace and --leader-lease, exits 1."""
    missing = f"kiln-nowhere-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "KILN_METRICS_PORT": str(free_port())}
    env.pop("KUBECONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "operator", "--kubeconfig", str(rig.kubeconfig),
                           "--health-port", "0", "--leader-lease", f"{missing}/kiln-operator"],
                          capture_output=True, text=True, env=env, timeout=SAFETY_TIMEOUT_S, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kiln: error: cannot create the leader election Lease {missing}/kiln-operator: "
                           f"namespace {missing} does not exist;") and "--leader-lease" in last, proc.stderr[-3000:]
