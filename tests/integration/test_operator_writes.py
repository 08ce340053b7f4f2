"""What new runs and an operator restart cost in writes of TrainingSpecs (issue 13, item 9), counted on the rig
through the operator benchmark's counting proxy. Each write of a TrainingSpec costs the apiserver 12-15 ms of
CPU (the CRD's schema and CEL rules run on every write): in a burst of new runs they were most of its work.

- A new run: one status write, by its reconcile. Not kopf's `last-handled-configuration` annotation (its diff
  base is kept in memory), not a second status once the training-operator marks the job suspended (nothing
  a write would carry changed), not the goodput ledger alone at the run's first tick (once a minute); and its
  ticks read nothing.
- A restart: a spec edited while no operator ran is acted on; runs that did not change get no write, and each
  of a run's objects is applied once (no storm of re-applies).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kiln.control.kube import Kube, api_client
from tests.bench.bench_operator import CountingProxy, create_specs, settle, specs, trainingspec_writes
from tests.rig.install import install_crd, scratch_namespace
from tests.support.operator import Operator, get
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig

RUNS = 3
OBJECTS_PER_RUN = 6  # ServiceAccount, Role, RoleBinding, NetworkPolicy, ConfigMap, PyTorchJob


@pytest.fixture(scope="module")
def ns(rig):
    with scratch_namespace(rig, "kiln-writes") as name:
        yield name


def writes_by_run(calls: list[tuple[float, str, str]]) -> Counter:
    """TrainingSpec writes by (run, what): 'status' or 'object' (kopf's annotations)."""
    found = Counter()
    for call in calls:
        if trainingspec_writes([call]):
            parts = call[2].split("/trainingspecs/", 1)[1].split("/")
            found[(parts[0], "status" if parts[1:] == ["status"] else "object")] += 1
    return found


def test_a_new_run_costs_one_status_write_and_a_restart_only_what_changed(rig, ns, tmp_path):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))
    proxy = CountingProxy(rig.kubeconfig)
    op = Operator(proxy.kubeconfig(tmp_path / "proxy.kubeconfig"), ns, tmp_path / "operator.log")
    op.start()
    alive = lambda: op.proc.poll() is None  # noqa: E731
    try:
        proxy.wait_watching(alive)
        mark = len(proxy.calls)
        names = list(create_specs(kube, ns, specs(ns, RUNS)))
        settle(kube, op, ns, names)  # the training-operator marked each job, and each run ticked once since
        window = proxy.calls[mark:]
        assert writes_by_run(window) == {(n, "status"): 1 for n in names}
        # nor a read: a tick of a suspended run asks nothing, even before its job is marked suspended
        assert not [path for _, method, path in window if method == "GET" and "/trainingspecs/" in path]
        for name in names:
            annotations = get(rig, ns, "trainingspec", name)["metadata"].get("annotations") or {}
            assert not [k for k in annotations if k.endswith("last-handled-configuration")], annotations

        # edited while no operator runs: acted on after the start; the others cost no write
        op.stop()
        edited = names[0]
        rig.kubectl("patch", "trainingspec", edited, "-n", ns, "--type", "merge",
                    "-p", json.dumps({"spec": {"training": {"steps": 20}}}))
        generation = get(rig, ns, "trainingspec", edited)["metadata"]["generation"]
        op.start()
        mark = len(proxy.calls)
        rig.wait_for("every run reconciled after the start", lambda: all(
            f"{ns}/{n}: Applied" in op.log_since_start() for n in names), timeout=SAFETY_TIMEOUT_S)
        after = proxy.calls[mark:]
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail()}")
    assert writes_by_run(after) == {(edited, "status"): 1}
    status = get(rig, ns, "trainingspec", edited)["status"]
    assert status["observedGeneration"] == generation and status["phase"] == "Suspended"
    assert "steps: 20" in get(rig, ns, "configmap", f"{edited}-spec")["data"]["spec.yaml"]
    applies = Counter(path for _, method, path in after if method == "PATCH" and "/trainingspecs" not in path)
    assert len(applies) == RUNS * OBJECTS_PER_RUN and set(applies.values()) == {1}, applies
