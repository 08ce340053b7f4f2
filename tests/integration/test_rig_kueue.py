"""Kueue on the rig (tests/rig/kueue.py): the real manager admits PyTorchJobs by quota, through its webhooks.

Plain PyTorchJobs here, no kiln operator: what Kueue itself does on the rig, which kiln's scheduling
builds on (tests/integration/test_operator_kueue.py has kiln's side).
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig

GPU = "nvidia.com/gpu"


def pytorch_job(name: str, workers: int, gpus: int, queue: str | None) -> dict:
    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    container = {"name": "pytorch", "image": "kiln-trainer:test", "command": ["torchrun", "train.py"],
                 "resources": {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus), "cpu": "1", "memory": "1Gi"}}}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "labels": labels},
        "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": {"Worker": {
            "replicas": workers, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}}},
    }


def get(rig, kind: str, namespace: str, name: str) -> dict:
    return json.loads(rig.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)


def workload_of(rig, namespace: str, job: str) -> dict | None:
    """The Workload Kueue made for the PyTorchJob `job` (owned by it), if any."""
    items = json.loads(rig.kubectl("get", "workloads.kueue.x-k8s.io", "-n", namespace, "-o", "json").stdout)["items"]
    return next((w for w in items if any(o.get("kind") == "PyTorchJob" and o.get("name") == job
                                         for o in w["metadata"].get("ownerReferences") or [])), None)


def condition(obj: dict | None, ctype: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def running_pods(rig, namespace: str, job: str) -> list[str]:
    out = rig.kubectl("get", "pods", "-n", namespace, "-l", f"training.kubeflow.org/job-name={job}", "-o", "json")
    return [p["metadata"]["name"] for p in json.loads(out.stdout)["items"] if p["status"].get("phase") == "Running"]


def pods(rig, namespace: str, job: str) -> list[dict]:
    out = rig.kubectl("get", "pods", "-n", namespace, "-l", f"training.kubeflow.org/job-name={job}", "-o", "json")
    return json.loads(out.stdout)["items"]


@pytest.fixture
def queue(rig, kueue, namespace):
    """A ClusterQueue of one node's GPUs (8) for this test's namespace, and its LocalQueue `team`."""
    name = f"cq-{uuid.uuid4().hex[:8]}"
    rig.apply([kueue.cluster_queue(name, gpus=rig.gpus_per_node, namespaces=[namespace]),
               kueue.local_queue(namespace, "team", name)])
    yield "team"
    rig.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def test_webhook_suspends_a_queued_job_and_kueue_admits_it(rig, kueue, namespace, queue):
    with rig.exclusive_gpus():
        created = json.loads(rig.kubectl("create", "-n", namespace, "-o", "json", "-f", "-",
                                          input=json.dumps(pytorch_job("fits", 1, 8, queue))).stdout)
        # Kueue's mutating webhook (called by URL) suspended it at creation, before any pod could start.
        assert created["spec"]["runPolicy"]["suspend"] is True
        wl = rig.wait_for("the Workload admitted", lambda: (w := workload_of(rig, namespace, "fits"))
                          and condition(w, "Admitted").get("status") == "True" and w, timeout=SAFETY_TIMEOUT_S)
        assignment = wl["status"]["admission"]["podSetAssignments"][0]
        assert assignment["flavors"][GPU] == kueue.FLAVOR
        assert assignment["count"] == 1
        rig.wait_for("the admitted job's pod Running", lambda: running_pods(rig, namespace, "fits"),
                     timeout=SAFETY_TIMEOUT_S)
        # The flavor's node labels are injected into the admitted pods.
        pod = pods(rig, namespace, "fits")[0]
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": rig.gpu_product}


def test_a_job_over_quota_waits_with_kueues_reason_and_starts_when_quota_frees(rig, kueue, namespace, queue):
    with rig.exclusive_gpus():
        rig.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pytorch_job("first", 1, 8, queue)))
        rig.wait_for("first Running", lambda: running_pods(rig, namespace, "first"), timeout=SAFETY_TIMEOUT_S)
        rig.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pytorch_job("second", 1, 8, queue)))
        waiting = rig.wait_for("second's Workload pending", lambda: (w := workload_of(rig, namespace, "second"))
                               and condition(w, "QuotaReserved").get("reason") == "Pending" and w,
                               timeout=SAFETY_TIMEOUT_S)
        assert condition(waiting, "QuotaReserved")["status"] == "False"
        assert "insufficient unused quota for nvidia.com/gpu" in condition(waiting, "QuotaReserved")["message"]
        assert get(rig, "pytorchjob", namespace, "second")["spec"]["runPolicy"]["suspend"] is True
        assert pods(rig, namespace, "second") == []  # held back whole: no pod waits on a node
        rig.succeed_pod(namespace, "first-worker-0")
        rig.wait_for("second admitted once first finished", lambda: condition(
            workload_of(rig, namespace, "second"), "Admitted").get("status") == "True", timeout=SAFETY_TIMEOUT_S)
        rig.wait_for("second Running", lambda: running_pods(rig, namespace, "second"), timeout=SAFETY_TIMEOUT_S)


def test_a_job_larger_than_its_quota_starts_no_pod(rig, kueue, namespace, queue):
    """All or nothing: two nodes' worth of GPUs against one node's quota: no pod at all, not one of two."""
    with rig.exclusive_gpus():
        rig.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pytorch_job("big", 2, 8, queue)))
        w = rig.wait_for("big's Workload pending", lambda: (w := workload_of(rig, namespace, "big"))
                         and condition(w, "QuotaReserved").get("reason") == "Pending" and w, timeout=SAFETY_TIMEOUT_S)
        assert "insufficient quota" in condition(w, "QuotaReserved")["message"]
        assert get(rig, "pytorchjob", namespace, "big")["spec"]["runPolicy"]["suspend"] is True
        assert pods(rig, namespace, "big") == []


def test_a_job_without_a_queue_label_is_left_alone(rig, kueue, namespace):
    with rig.exclusive_gpus():
        rig.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pytorch_job("plain", 1, 1, None)))
        rig.wait_for("plain Running", lambda: running_pods(rig, namespace, "plain"), timeout=SAFETY_TIMEOUT_S)
        assert workload_of(rig, namespace, "plain") is None
        assert not get(rig, "pytorchjob", namespace, "plain")["spec"]["runPolicy"].get("suspend")


def test_kueues_validating_webhook_refuses_an_invalid_cluster_queue(rig, kueue):
    bad = kueue.cluster_queue(f"bad-{uuid.uuid4().hex[:6]}", gpus=8)
    # Quotas listed in another order than coveredResources: the CRD's schema allows it, Kueue's webhook not.
    quotas = bad["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    quotas[0], quotas[1] = quotas[1], quotas[0]
    proc = rig.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    assert "denied the request" in proc.stderr and "must match the name in coveredResources" in proc.stderr, proc.stderr

