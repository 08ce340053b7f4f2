"""kiln runs under Kueue on the rig: the real Kueue manager admits the PyTorchJobs the kiln operator renders.

The operator runs as its ServiceAccount with manifests/rbac (fixtures from test_operator_lifecycle); Kueue
is the rig's (tests/rig/kueue.py); each test gets its own ClusterQueue for the test's namespace and a
LocalQueue pointing at it. Runs take 4 of a kwok node's 8 GPUs per node and queues are sized in those
(GPUS): other sessions' tests place small pods on the shared nodes meanwhile.
"""

from __future__ import annotations

import math
import uuid

import pytest

from kiln.cli.main import main
from tests.rig.install import scratch_namespace
from tests.support.operator import (
    condition, events, get, items, patch_spec, running_operator, running_pods, status, submit, wait_phase,
)
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.specs import small_run

pytestmark = pytest.mark.rig

GPUS = 4  # per node of a run here; a queue of GPUS GPUs fits one 1-node run


@pytest.fixture(scope="module")
def ns(rig):
    with scratch_namespace(rig, "kiln-kueue") as name:
        yield name


@pytest.fixture(scope="module")
def operator(rig, kueue, ns, tmp_path_factory):
    """The operator as its cluster-wide ServiceAccount with the shipped RBAC (it may list Workloads)."""
    with running_operator(rig, ns, "cluster", tmp_path_factory.mktemp("operator")) as op:
        yield op


@pytest.fixture
def team(rig, kueue, ns):
    """LocalQueue `team` in `ns` → a fresh ClusterQueue of GPUS GPUs (one 1-node run); yields its name."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=GPUS, namespaces=[ns]),
               kueue.local_queue(ns, "team", name)])
    yield name
    rig.kubectl("delete", "localqueue", "team", "-n", ns, check=False)
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def node_run(name: str, nodes: int = 1, **spec) -> dict:
    """A run of `nodes` nodes × GPUS GPUs in the LocalQueue `team`."""
    return small_run(name, resources={"nodes": nodes, "gpusPerNode": GPUS, **spec.pop("resources", {})},
                     elastic={"minNodes": nodes, "maxNodes": nodes},
                     scheduling={"queue": "team", **spec.pop("scheduling", {})}, **spec)


def queued(rig, ns: str, name: str) -> dict:
    return rig.wait_for(f"{name} Queued with Kueue's reason (now {status(rig, ns, name).get('phase')})",
                        lambda: status(rig, ns, name).get("phase") == "Queued"
                        and (c := condition(rig, ns, name, "Queued")).get("status") == "True"
                        and c.get("reason") not in ("NoWorkload", "WaitingForKueue") and c,  # kiln's own reasons
                        timeout=SAFETY_TIMEOUT_S)


def test_second_run_waits_queued_with_kueues_reason_then_starts_when_the_first_finishes(
        rig, ns, operator, team, capsys):
    with rig.exclusive_gpus():
        submit(rig, ns, node_run("first"))
        first = wait_phase(rig, ns, "first", "Running")
        assert first["queue"]["clusterQueue"] == team and first["queue"]["flavors"] == ["rig-h200"]
        assert first["queue"]["admittedAt"]

        submit(rig, ns, node_run("second"))
        cond = queued(rig, ns, "second")
        assert cond["reason"] == "Pending" and "insufficient unused quota for nvidia.com/gpu" in cond["message"], cond
        assert not items(rig, ns, "pods", "kiln.dev/trainingspec=second")  # waits whole: no pod holds a node
        assert any(e["reason"] == "Queued" for e in events(rig, ns, "second"))
        assert main(["status", "second", "-n", ns, "--kubeconfig", str(rig.kubeconfig)]) == 0
        out = capsys.readouterr().out
        assert "Queued" in out and "insufficient unused quota" in out, out

        rig.succeed_pod(ns, "first-worker-0")
        wait_phase(rig, ns, "first", "Succeeded")
        second = wait_phase(rig, ns, "second", "Running")
        assert second["queue"]["admittedAt"] >= first["queue"]["admittedAt"]
        assert condition(rig, ns, "second", "Queued")["reason"] == "Admitted"
        assert len(running_pods(rig, ns, "second")) == 1
        rig.succeed_pod(ns, "second-worker-0")
        wait_phase(rig, ns, "second", "Succeeded")


def test_a_run_larger_than_the_quota_starts_no_pod(rig, ns, operator, team):
    """All or nothing: a 2-node run whose queue can give it 1 node's worth of GPUs starts no pod at all.
    (No GPU is used, so no turn on the rig's GPUs is needed.)"""
    submit(rig, ns, node_run("too-big", nodes=2))
    cond = queued(rig, ns, "too-big")
    assert "insufficient quota for nvidia.com/gpu" in cond["message"], cond
    assert get(rig, ns, "pytorchjob", "too-big")["spec"]["runPolicy"]["suspend"] is True
    assert not items(rig, ns, "pods", "kiln.dev/trainingspec=too-big")
    rig.kubectl("delete", "trainingspec", "too-big", "-n", ns)


@pytest.fixture
def gpu_only_team(rig, kueue, ns):
    """LocalQueue `gpu-team` → a ClusterQueue covering only cpu, memory and nvidia.com/gpu, as Kueue's own
    examples do (no ephemeral-storage); yields the ClusterQueue's name."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=GPUS, namespaces=[ns], covered=("cpu", "memory", "nvidia.com/gpu")),
               kueue.local_queue(ns, "gpu-team", name)])
    yield name
    rig.kubectl("delete", "localqueue", "gpu-team", "-n", ns, check=False)
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def test_a_queue_that_covers_only_cpu_memory_and_gpus_admits_the_run(rig, kueue, ns, operator, gpu_only_team, capsys):
    """kiln's default local-disk request is left out for such a queue and the run is admitted and runs; a
    run whose spec asks for local disk is refused by field with nothing applied, and starts once the admin
    covers ephemeral-storage (the operator retries)."""
    gpu_team = {"queue": "gpu-team"}
    submit(rig, ns, node_run("disk", scheduling=gpu_team, resources={"ephemeralStorage": "10Gi"}))
    refused = rig.wait_for("disk refused as not covered by its queue",
                           lambda: (c := condition(rig, ns, "disk", "SpecAccepted")).get("reason") == "NotCoveredByQueue"
                           and c, timeout=SAFETY_TIMEOUT_S)
    assert refused["status"] == "False" and "spec.resources.ephemeralStorage" in refused["message"], refused
    assert f"ClusterQueue {gpu_only_team}" in refused["message"] and "coveredResources" in refused["message"]
    assert not items(rig, ns, "pytorchjobs", "kiln.dev/trainingspec=disk")  # nothing applied
    assert main(["status", "-n", ns, "--kubeconfig", str(rig.kubeconfig)]) == 0
    assert "disk: SpecAccepted NotCoveredByQueue: spec.resources.ephemeralStorage" in capsys.readouterr().out

    with rig.exclusive_gpus():
        submit(rig, ns, node_run("plain", scheduling=gpu_team))
        st = wait_phase(rig, ns, "plain", "Running")
        assert st["queue"]["clusterQueue"] == gpu_only_team
        (pod,) = running_pods(rig, ns, "plain")
        resources = pod["spec"]["containers"][0]["resources"]
        assert "ephemeral-storage" not in resources.get("requests", {}) and resources["limits"]["nvidia.com/gpu"] == "4"
        accepted = condition(rig, ns, "plain", "SpecAccepted")
        assert accepted["status"] == "True" and "do not request ephemeral-storage" in accepted["message"], accepted

        # the admin covers local disk: the refused run is made on the operator's retry, without a spec change
        rig.apply([kueue.cluster_queue(gpu_only_team, gpus=GPUS, namespaces=[ns])])
        job = rig.wait_for("disk's PyTorchJob made once its queue covers ephemeral-storage",
                           lambda: next(iter(items(rig, ns, "pytorchjobs", "kiln.dev/trainingspec=disk")), None),
                           timeout=SAFETY_TIMEOUT_S)
        limits = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["ephemeral-storage"] == "10Gi"
        rig.succeed_pod(ns, "plain-worker-0")
        wait_phase(rig, ns, "plain", "Succeeded")
    rig.kubectl("delete", "trainingspec", "disk", "-n", ns)


@pytest.fixture
def priorities(rig, kueue):
    """WorkloadPriorityClasses `low-…` (10) and `high-…` (1000); yields their names."""
    suffix = uuid.uuid4().hex[:6]
    names = {"low": f"low-{suffix}", "high": f"high-{suffix}"}
    rig.apply([{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": n},
                "value": value, "description": f"kiln rig test, {key}"}
               for (key, n), value in zip(names.items(), (10, 1000))])
    yield names
    for n in names.values():
        rig.kubectl("delete", "workloadpriorityclass", n, "--wait=false", check=False)


@pytest.fixture
def preempting_team(rig, kueue, ns):
    """LocalQueue `urgent` → a ClusterQueue like `team`'s that preempts lower-priority workloads to admit a
    higher one; yields the LocalQueue's name."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=GPUS, namespaces=[ns],
                                   preemption={"withinClusterQueue": "LowerPriority"}),
               kueue.local_queue(ns, "urgent", name)])
    yield "urgent"
    rig.kubectl("delete", "localqueue", "urgent", "-n", ns, check=False)
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def test_higher_priority_run_preempts_a_lower_one_which_resumes_later(rig, ns, operator, preempting_team, priorities):
    with rig.exclusive_gpus():
        submit(rig, ns, node_run("low", scheduling={"queue": preempting_team, "priority": priorities["low"]}))
        wait_phase(rig, ns, "low", "Running")
        (low_pod,) = running_pods(rig, ns, "low")
        low_admitted = status(rig, ns, "low")["queue"]["admittedAt"]
        pending_before = status(rig, ns, "low")["goodputDetail"]["lostSeconds"]["pending"]

        submit(rig, ns, node_run("high", scheduling={"queue": preempting_team, "priority": priorities["high"]}))
        cond = rig.wait_for("low preempted", lambda: (c := condition(rig, ns, "low", "Queued")).get("reason")
                            == "Preempted" and c, timeout=SAFETY_TIMEOUT_S)
        assert status(rig, ns, "low")["phase"] == "Queued" and cond["status"] == "True"
        # Kueue suspended the job, kiln's spec did not change: the same path as spec.suspend, where the
        # training-operator deletes the pods and each trainer gets SIGTERM to commit within the grace period.
        assert get(rig, ns, "pytorchjob", "low")["spec"]["runPolicy"]["suspend"] is True
        assert get(rig, ns, "trainingspec", "low")["spec"].get("suspend") in (None, False)
        rig.wait_for("low's pod gone", lambda: get(rig, ns, "pod", low_pod["metadata"]["name"]) is None
                     or get(rig, ns, "pod", low_pod["metadata"]["name"])["metadata"]["uid"] != low_pod["metadata"]["uid"],
                     timeout=SAFETY_TIMEOUT_S)
        wait_phase(rig, ns, "high", "Running")
        assert any(e["reason"] == "Queued" and "Preempted" in e["message"] for e in events(rig, ns, "low"))

        rig.succeed_pod(ns, "high-worker-0")
        wait_phase(rig, ns, "high", "Succeeded")
        resumed = wait_phase(rig, ns, "low", "Running")
        assert resumed["queue"]["admittedAt"] > low_admitted
        # the ledger counts the time it waited preempted as preempted, not as pending
        lost = resumed["goodputDetail"]["lostSeconds"]
        assert lost["preempted"] > 0 and lost["pending"] >= pending_before
        rig.succeed_pod(ns, "low-worker-0")
        wait_phase(rig, ns, "low", "Succeeded")


@pytest.fixture
def hosts(rig, kueue, ns):
    """LocalQueue `hosts` → a ClusterQueue of 2 × GPUS GPUs in the topology-aware flavor."""
    rig.apply([kueue.topology(), kueue.tas_flavor()])  # as the rig's Kueue makes them (idempotent)
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=2 * GPUS, namespaces=[ns], flavor=kueue.TAS_FLAVOR),
               kueue.local_queue(ns, "hosts", name)])
    yield name
    rig.kubectl("delete", "localqueue", "hosts", "-n", ns, check=False)
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def test_a_run_within_quota_that_the_free_nodes_cannot_hold_starts_no_pod_then_starts_whole(
        rig, kueue, ns, operator, hosts):
    """All or nothing against real capacity: the queue's quota fits a 2-node run (2 × 4 GPUs), but pods
    outside Kueue hold 5 GPUs of one node and 3 of the other: 8 GPUs are free, yet only one pod of 4 fits.
    Topology-aware admission counts those pods, so the run stays Queued with no pod (none holding GPUs
    while the other cannot start). Once a holder is gone it starts with both pods.

    Kueue v0.17.0 updates its view when a pod outside Kueue ends but does not retry the workloads it found
    inadmissible (kubernetes-sigs/kueue#8653, fixed in v0.18.x and v0.19.1): they wait for the next event
    that does (a node's labels, taints, allocatable or readiness changing, a workload of the ClusterQueue
    finishing, a queue or flavor edit). The test gives it one, as an admin would: a label on a node."""
    held = dict(zip(rig.gpu_nodes, (rig.gpus_per_node - GPUS + 1, GPUS - 1)))
    with rig.exclusive_gpus():
        for i, (node, gpus) in enumerate(held.items()):
            rig.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"holder-{i}", "namespace": ns},
                       "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox", "resources": {
                           "limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}}]}})
        for i in range(len(held)):
            rig.wait_for(f"holder-{i} Running", lambda i=i: (get(rig, ns, "pod", f"holder-{i}") or {}).get(
                "status", {}).get("phase") == "Running", timeout=SAFETY_TIMEOUT_S)
        try:
            submit(rig, ns, node_run("wide", nodes=2, scheduling={"queue": "hosts"}))
            cond = queued(rig, ns, "wide")
            assert cond["reason"] == "Pending" and "insufficient" not in cond["message"], cond  # quota is not why
            assert not items(rig, ns, "pods", "kiln.dev/trainingspec=wide")
            assert get(rig, ns, "pytorchjob", "wide")["spec"]["runPolicy"]["suspend"] is True

            rig.kubectl("delete", "pod", "holder-0", "-n", ns, "--grace-period=0")
            rig.wait_for("holder-0 gone", lambda: get(rig, ns, "pod", "holder-0") is None, timeout=SAFETY_TIMEOUT_S)
            rig.kubectl("label", "node", rig.gpu_nodes[0], f"rig.kiln.dev/requeue={uuid.uuid4().hex[:8]}",
                        "--overwrite")  # the retry Kueue v0.17.0 does not make by itself (docstring)
            wait_phase(rig, ns, "wide", "Running")
            assert len(running_pods(rig, ns, "wide")) == 2  # whole: both pods
        finally:
            rig.kubectl("label", "node", rig.gpu_nodes[0], "rig.kiln.dev/requeue-", check=False)
            rig.kubectl("delete", "trainingspec", "wide", "-n", ns, "--wait=false", check=False)
            for i in range(len(held)):
                rig.kubectl("delete", "pod", f"holder-{i}", "-n", ns, "--grace-period=0", check=False)


# ---- topology-aware placement: the rig's pool of 2 blocks × 2 racks × 2 hosts (tests/rig/kueue.py) ----

@pytest.fixture
def racks(rig, kueue, ns):
    """LocalQueue `racks` → a fresh ClusterQueue of all the topology pool's GPUs (its flavor rig-h200-racks)."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=len(kueue.POOL_NODES) * rig.gpus_per_node, namespaces=[ns],
                                   flavor=kueue.POOL_FLAVOR),
               kueue.local_queue(ns, "racks", name)])
    yield name
    rig.kubectl("delete", "localqueue", "racks", "-n", ns, check=False)
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def pool_run(rig, name: str, nodes: int, topology: dict | None = None, **elastic) -> dict:
    """A run of whole pool nodes (8 GPUs each) in the LocalQueue `racks`; no gpuType (the pool's nodes carry
    no product label: the flavor selects them)."""
    body = node_run(name, nodes, scheduling={"queue": "racks", **({"topology": topology} if topology else {})})
    body["spec"]["resources"] = {"nodes": nodes, "gpusPerNode": rig.gpus_per_node}
    body["spec"]["elastic"] = {"minNodes": nodes, "maxNodes": nodes, **elastic}
    # one sample per rank at every node count the run may take (whole data-parallel groups)
    body["spec"]["training"]["globalBatchSize"] = rig.gpus_per_node * math.lcm(
        *range(nodes, body["spec"]["elastic"]["maxNodes"] + 1))
    return body


def placed(rig, kueue, ns: str, name: str, level: str) -> list[str]:
    """The `level` label of each running pod's node."""
    return sorted(kueue.POOL_NODES[p["spec"]["nodeName"]][level] for p in running_pods(rig, ns, name))


def test_required_rack_lands_in_one_rack_and_a_run_no_rack_can_hold_waits_with_kueues_reason(
        rig, kueue, ns, operator, racks, capsys):
    try:
        submit(rig, ns, pool_run(rig, "one-rack", 2, {"level": kueue.RACK_LABEL, "mode": "required"}))
        submit(rig, ns, pool_run(rig, "too-wide", 3, {"level": kueue.RACK_LABEL}))  # a rack has 2 hosts
        submit(rig, ns, pool_run(rig, "no-level", 1, {"level": "topology.kubernetes.io/zone"}))

        st = wait_phase(rig, ns, "one-rack", "Running")
        assert st["queue"]["flavors"] == [kueue.POOL_FLAVOR]
        rig.wait_for("both pods running", lambda: len(running_pods(rig, ns, "one-rack")) == 2,
                     timeout=SAFETY_TIMEOUT_S)
        in_racks = placed(rig, kueue, ns, "one-rack", kueue.RACK_LABEL)
        assert len(in_racks) == 2 and len(set(in_racks)) == 1, in_racks
        # status says where Kueue placed it: the domains at its levels, down to the pods' nodes
        topology = status(rig, ns, "one-rack")["queue"]["topology"]
        assert topology["levels"][-1] == kueue.HOST_LABEL, topology
        assert sorted(d.split("/")[-1] for d in topology["domains"]) == sorted(
            p["spec"]["nodeName"] for p in running_pods(rig, ns, "one-rack")), topology
        assert main(["status", "one-rack", "-n", ns, "--kubeconfig", str(rig.kubeconfig)]) == 0
        out = capsys.readouterr().out
        assert kueue.POOL_FLAVOR in out and all(d in out for d in topology["domains"]), out
        # kiln's forced re-apply after a spec edit keeps the flavor's toleration Kueue added to the template:
        # a pod made again (a restart) must still tolerate the pool's taint
        flavor_toleration = kueue.pool_flavor()["spec"]["tolerations"][0]
        worker = lambda: get(rig, ns, "pytorchjob", "one-rack")["spec"]["pytorchReplicaSpecs"]["Worker"]  # noqa: E731
        assert flavor_toleration in worker()["template"]["spec"]["tolerations"]
        patch_spec(rig, ns, "one-rack", {"elastic": {"maxRestarts": 7}})
        rig.wait_for("the edit applied", lambda: get(rig, ns, "pytorchjob", "one-rack")["spec"]["runPolicy"][
            "backoffLimit"] == 7, timeout=SAFETY_TIMEOUT_S)
        assert flavor_toleration in worker()["template"]["spec"]["tolerations"]

        cond = queued(rig, ns, "too-wide")
        # a rack holds 2 of its 3 pods (the other rack's 2 hosts are the first run's)
        assert cond["reason"] == "Pending" and f'topology "{kueue.POOL_TOPOLOGY}" allows to fit only 2 out of 3' in \
            cond["message"], cond
        cond = queued(rig, ns, "no-level")
        assert f'Flavor "{kueue.POOL_FLAVOR}" does not contain the requested level' in cond["message"], cond
        for name in ("too-wide", "no-level"):
            assert not items(rig, ns, "pods", f"kiln.dev/trainingspec={name}")
    finally:
        for name in ("one-rack", "too-wide", "no-level"):
            rig.kubectl("delete", "trainingspec", name, "-n", ns, "--wait=false", check=False)


def test_preferred_rack_packs_a_run_too_wide_for_a_rack_into_one_block(rig, kueue, ns, operator, racks):
    try:
        submit(rig, ns, pool_run(rig, "packed", 3, {"level": kueue.RACK_LABEL, "mode": "preferred"}))
        wait_phase(rig, ns, "packed", "Running")
        rig.wait_for("three pods running", lambda: len(running_pods(rig, ns, "packed")) == 3,
                     timeout=SAFETY_TIMEOUT_S)
        blocks, in_racks = placed(rig, kueue, ns, "packed", kueue.BLOCK_LABEL), placed(rig, kueue, ns, "packed",
                                                                                        kueue.RACK_LABEL)
        assert len(set(blocks)) == 1 and len(set(in_racks)) == 2, (blocks, in_racks)  # one block: 2 racks
    finally:
        rig.kubectl("delete", "trainingspec", "packed", "-n", ns, "--wait=false", check=False)


def test_a_queued_elastic_run_starts_at_min_nodes_and_does_not_grow_past_its_admission(
        rig, kueue, ns, operator, racks):
    """minNodes 1, maxNodes 2, with 8 free pool nodes the elastic loop counts (no gpuType): unqueued it would
    grow to 2 at its first tick; queued it keeps the 1 node its Workload asked for, and no pod waits Pending."""
    try:
        submit(rig, ns, pool_run(rig, "queued-elastic", 1, maxNodes=2))
        wait_phase(rig, ns, "queued-elastic", "Running")
        cond = rig.wait_for("the elastic loop's decision", lambda: (c := condition(
            rig, ns, "queued-elastic", "Elastic")).get("message", "").startswith("queued:") and c,
            timeout=SAFETY_TIMEOUT_S)
        assert cond["reason"] == "Steady", cond
        job = get(rig, ns, "pytorchjob", "queued-elastic")
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
        pods = items(rig, ns, "pods", "kiln.dev/trainingspec=queued-elastic")
        assert [p["status"].get("phase") for p in pods] == ["Running"]
    finally:
        rig.kubectl("delete", "trainingspec", "queued-elastic", "-n", ns, "--wait=false", check=False)


# ---- replica groups: each group's PyTorchJob has a Workload of its own and is admitted alone ----

def group_run(name: str, groups: int = 2) -> dict:
    """A run of `groups` replica groups of one node × GPUS GPUs each, in the LocalQueue `team`."""
    return small_run(name, resources={"nodes": groups, "gpusPerNode": GPUS},
                     elastic={"faultTolerance": {"mode": "replicaGroups", "groups": groups}},
                     scheduling={"queue": "team"})


def test_a_group_run_trains_with_the_group_its_quota_admits_and_names_the_group_that_waits(
        rig, kueue, ns, operator, team, capsys):
    """2 groups in a queue whose quota holds one group's GPUs: Kueue admits one group, whose pod runs, and the
    run is Running (torchft trains with the groups it has); the other group waits with Kueue's reason, named
    in condition Queued (False: the run is not queued as a whole). More quota: the second group is admitted."""
    name = "grouped"
    with rig.exclusive_gpus():
        try:
            submit(rig, ns, group_run(name))
            # (the run is Running once the training-operator marks the admitted group's job Running)
            st = rig.wait_for(
                "the run Running with one group, the other queued with Kueue's reason",
                lambda: (s := status(rig, ns, name)) and s.get("phase") == "Running"
                and len(g := s.get("replicaGroups") or []) == 2
                and sorted(x["phase"] for x in g) == ["Pending", "Running"]
                and any(x.get("queued") and x.get("queueReason") == "Pending" for x in g) and s,
                timeout=SAFETY_TIMEOUT_S)
            ran, waits = sorted(st["replicaGroups"], key=lambda x: x["phase"] != "Running")
            assert ran["queued"] is False and ran["admittedAt"] and ran["pods"] == 1
            assert "insufficient unused quota for nvidia.com/gpu" in waits["queueMessage"], waits
            assert st["queue"]["waitingGroups"] == [waits["group"]] and st["queue"]["clusterQueue"] == team
            cond = condition(rig, ns, name, "Queued")
            assert (cond["status"], cond["reason"]) == ("False", "GroupsWaiting"), cond
            assert f"{name}-g{waits['group']}" in cond["message"] and "insufficient unused quota" in cond["message"]
            # the waiting group holds no node: its job stays suspended, no pod of it exists
            assert get(rig, ns, "pytorchjob", waits["job"])["spec"]["runPolicy"]["suspend"] is True
            assert not items(rig, ns, "pods", f"kiln.dev/replica-group={waits['group']},kiln.dev/trainingspec={name}")
            assert [p["metadata"]["labels"]["kiln.dev/replica-group"] for p in running_pods(rig, ns, name)] == \
                [str(ran["group"])]
            assert any(e["reason"] == "Queued" and waits["job"] in e["message"] for e in events(rig, ns, name))
            assert main(["status", name, "-n", ns, "--kubeconfig", str(rig.kubeconfig)]) == 0
            out = capsys.readouterr().out
            assert "GroupsWaiting" in out and waits["job"] in out, out

            # the admin raises the quota to both groups' GPUs: Kueue admits the waiting group
            rig.apply(kueue.cluster_queue(team, gpus=2 * GPUS, namespaces=[ns]))
            both = rig.wait_for("both groups admitted and running",
                                lambda: (s := status(rig, ns, name)) and all(
                                    x["phase"] == "Running" and x.get("queued") is False for x in s["replicaGroups"])
                                and s, timeout=SAFETY_TIMEOUT_S)
            assert both["phase"] == "Running" and both["queue"]["waitingGroups"] == [] and both["nodes"] == 2
            assert both["replicaGroups"][waits["group"]]["admittedAt"] >= ran["admittedAt"]
            cond = condition(rig, ns, name, "Queued")
            assert (cond["status"], cond["reason"]) == ("False", "Admitted"), cond
        finally:
            rig.kubectl("delete", "trainingspec", name, "-n", ns, "--wait=false", check=False)
