"""Replica groups (elastic.faultTolerance replicaGroups) on the rig: the operator, as its shipped cluster-wide
ServiceAccount, creates the torchft lighthouse and one PyTorchJob per group, all owned by the run; a group
that loses its pod restarts alone while the run stays Running, and status shows it.

Real kube-apiserver, controller-manager (Deployments, garbage collection), the Kubeflow training-operator
and kwok GPU nodes: pods run, fail or succeed on demand, no trainer runs (the trainer's side of replica
groups is tests/distributed/test_ft_replica_groups.py).
"""

from __future__ import annotations

import pytest

from tests.rig.install import scratch_namespace
from tests.support.operator import events, get, items, running_operator, status, submit
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.specs import small_run

pytestmark = pytest.mark.rig

RUN = "groups"
GROUP_LABEL = "kiln.dev/replica-group"


@pytest.fixture(scope="module")
def ns(rig):
    with scratch_namespace(rig, "kiln-ft") as name:
        yield name


@pytest.fixture(scope="module")
def operator(rig, ns, tmp_path_factory):
    with running_operator(rig, ns, "cluster", tmp_path_factory.mktemp("operator")) as op:
        yield op


def groups_status(rig, ns: str) -> list[dict]:
    return status(rig, ns, RUN).get("replicaGroups") or []


def test_lighthouse_and_a_job_per_group_then_a_lost_group_restarts_alone(rig, ns, operator):
    submit(rig, ns, small_run(RUN, resources={"nodes": 2},
                              elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}}))
    ts = rig.wait_for("the run", lambda: get(rig, ns, "trainingspec", RUN), timeout=SAFETY_TIMEOUT_S)
    uid = ts["metadata"]["uid"]

    # every object, owned by the run (the garbage collector removes them with it)
    made = {(kind, name): rig.wait_for(f"{kind}/{name}", lambda kind=kind, name=name: get(rig, ns, kind, name),
                                       timeout=SAFETY_TIMEOUT_S)
            for kind, name in [("pytorchjob", f"{RUN}-g0"), ("pytorchjob", f"{RUN}-g1"),
                               ("deployment", f"{RUN}-lighthouse"), ("service", f"{RUN}-lighthouse"),
                               ("networkpolicy", f"{RUN}-lighthouse"), ("networkpolicy", f"{RUN}-trainer"),
                               ("configmap", f"{RUN}-spec")]}
    for (kind, name), obj in made.items():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, f"{kind}/{name}"
    assert get(rig, ns, "pytorchjob", RUN) is None  # no job of the whole run beside the groups'
    for group in (0, 1):
        job = made[("pytorchjob", f"{RUN}-g{group}")]
        env = {e["name"]: e.get("value") for e in
               job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]}
        assert env["KILN_FT_GROUP"] == str(group) and env["KILN_FT_LIGHTHOUSE"] == f"http://{RUN}-lighthouse:29510"
    service = made[("service", f"{RUN}-lighthouse")]
    assert service["spec"]["selector"] == {"kiln.dev/lighthouse": RUN} and service["spec"]["clusterIP"]

    # one pod per group, both running; status shows each group
    running = rig.wait_for("both groups Running in status",
                           lambda: (g := groups_status(rig, ns)) and all(x["phase"] == "Running" for x in g) and g,
                           timeout=SAFETY_TIMEOUT_S)
    assert [(g["group"], g["job"], g["pods"], g["restarts"]) for g in running] == \
        [(0, f"{RUN}-g0", 1, 0), (1, f"{RUN}-g1", 1, 0)]
    pods = items(rig, ns, "pods", f"kiln.dev/trainingspec={RUN}")
    assert sorted(p["metadata"]["labels"][GROUP_LABEL] for p in pods) == ["0", "1"]
    assert status(rig, ns, RUN)["phase"] == "Running" and status(rig, ns, RUN)["nodes"] == 2

    # group 1 loses its pod (killed: a retryable exit code): it restarts alone, the run stays Running
    rig.fail_pod(ns, f"{RUN}-g1-worker-0", exit_code=137)
    lost = rig.wait_for("group 1's restart in status",
                        lambda: (s := status(rig, ns, RUN)) and (s.get("replicaGroups") or [{}, {}])[1].get("restarts")
                        and s, timeout=SAFETY_TIMEOUT_S)
    assert lost["phase"] == "Running" and lost.get("restarts", 0) == 0  # not a restart of the run
    assert lost["replicaGroups"][0]["phase"] == "Running" and lost["replicaGroups"][0]["restarts"] == 0
    assert lost["replicaGroups"][1]["restarts"] == 1
    lost_events = [e for e in events(rig, ns, RUN) if e["reason"] == "ReplicaGroupLost"]
    assert lost_events and f"{RUN}-g1" in lost_events[0]["message"] and lost_events[0]["type"] == "Warning"
    # the training-operator starts it again: Running, still one restart
    back = rig.wait_for("group 1 back", lambda: (g := groups_status(rig, ns)) and g[1]["phase"] == "Running" and g,
                        timeout=SAFETY_TIMEOUT_S)
    assert back[1]["restarts"] == 1 and back[0]["restarts"] == 0
    assert status(rig, ns, RUN)["phase"] == "Running"

    # deleting the run deletes the lighthouse and every group's job with it
    rig.kubectl("delete", "trainingspec", RUN, "-n", ns)
    for kind, name in made:
        rig.wait_for(f"{kind}/{name} deleted", lambda kind=kind, name=name: get(rig, ns, kind, name) is None,
                     timeout=SAFETY_TIMEOUT_S)
