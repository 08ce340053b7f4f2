"""Elastic scaling on the rig: real apiserver, scheduler, controller-manager, training-operator, kwok GPU nodes.

A 2-node job (minNodes 1) runs on both kwok GPU nodes; one node goes NotReady → the elastic loop
(kiln.control.elastic_sync.tick, the operator's timer body) force-deletes the pod stuck there, records
the node failure and shrinks the PyTorchJob to 1 worker; the node comes back → the job grows to 2 again;
the reported step stops moving → the workers are restarted (hang detection). A phase plan switches the
node count only once the boundary step is committed.

The operator's part (reconcile, elastic_sync.tick) runs as an operator ServiceAccount with exactly the
shipped RBAC (cluster-wide: manifests/rbac; namespaced: the chart with watchNamespaces), so a verb missing
there fails the test; the test itself observes, and plays the trainer's status reports, with the rig's admin
credentials. The tick gets the nodes and pods listed as that ServiceAccount (elastic_sync.listed); the running
operator keeps the same from its watches (test_operator_lifecycle's elastic test).
"""

from __future__ import annotations

import json
import time

import pytest

from kiln.api.spec import GROUP, VERSION
from kiln.control import elastic_sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.sync import reconcile
from tests.rig.install import install_crd
from tests.support.operator import operator_kube
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = [pytest.mark.rig, pytest.mark.slow]


@pytest.fixture(params=["cluster"])
def scope(request) -> str:
    return request.param


def watched(scope: str, namespace: str) -> list[str] | None:
    """The namespaces the operator would watch under this install (None: all)."""
    return None if scope == "cluster" else [namespace]


def _spec(rig, namespace: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingSpec",
            "metadata": {"name": "elastic", "namespace": namespace},
            "spec": {"image": "kiln-trainer:rig", "model": {"preset": "tiny"},
                     "training": {"steps": 100, "globalBatchSize": 16, "microBatchSize": 1},
                     "resources": {"nodes": 2, "gpusPerNode": rig.gpus_per_node, "gpuType": rig.gpu_product},
                     "elastic": {"minNodes": 1, "maxNodes": 2},
                     "checkpoint": {"uri": "file:///tmp/ckpt/"},
                     "scheduling": {"gang": False}}}


def _workers(kube: Kube, namespace: str) -> int:
    job = kube.job(namespace, "elastic")
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]


def _running_pods(kube: Kube, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in kube.pods(namespace, "elastic")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}


def _condition(kube: Kube, namespace: str) -> dict:
    body = kube.trainingspec(namespace, "elastic")
    return next(c for c in body["status"]["conditions"] if c["type"] == "Elastic")


def _wait_gpu_nodes_free(rig, kube: Kube, namespace: str) -> None:
    """Pods of earlier tests (namespaces are deleted asynchronously) may still hold the kwok GPUs."""
    def free() -> bool:
        pods = json.loads(kube.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        nodes = json.loads(kube.core.list_node(_preload_content=False).data)["items"]
        views = elastic_sync.node_views(nodes, pods, (namespace, "elastic"))
        return all(v.gpus_free == rig.gpus_per_node for v in views if v.name in rig.gpu_nodes)
    rig.wait_for("free kwok GPU nodes", free, timeout=SAFETY_TIMEOUT_S)


@pytest.mark.parametrize("scope", ["cluster", "namespaced"], indirect=True)
def test_node_not_ready_shrinks_the_job_and_its_return_grows_it(rig, namespace, scope, operator_kube):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))  # the test's eyes (admin); the operator acts as operator_kube
    events: list = []
    post = lambda body, event: events.append(event)  # noqa: E731 - the handler posts Events via kopf
    config = OperatorConfig(image="kiln-trainer:rig")
    tuning = elastic_sync.Tuning(grace_s=0.0, grow_cooldown_s=0.0)
    tick = lambda now_s: elastic_sync.tick(  # noqa: E731 - what the operator's watches hold, listed as the operator
        operator_kube, namespace, "elastic", config, post, now_s,
        elastic_sync.listed(operator_kube, namespace, "elastic", watched(scope, namespace)), tuning)
    bad = rig.gpu_nodes[1]
    with rig.exclusive_gpus():
        _wait_gpu_nodes_free(rig, kube, namespace)
        try:
            rig.apply(_spec(rig, namespace))
            body = kube.trainingspec(namespace, "elastic")
            reconcile(operator_kube, body, config, post)
            rig.wait_for("2 running workers", lambda: len(_running_pods(kube, namespace)) == 2,
                         timeout=SAFETY_TIMEOUT_S)
            summary = tick(time.time())
            assert "steady at 2" in summary and _workers(kube, namespace) == 2
            assert _condition(kube, namespace)["reason"] == "Steady"

            victim = next(p for p, n in _running_pods(kube, namespace).items() if n == bad)
            # Waited for by UID: the training-operator recreates a pod of the same name on the healthy node at once.
            victim_uid = next(p["metadata"]["uid"] for p in kube.pods(namespace, "elastic")
                              if p["metadata"]["name"] == victim)
            rig.set_node_ready(bad, False)
            rig.wait_for(f"{bad} NotReady", lambda: not rig.node_ready(bad), timeout=SAFETY_TIMEOUT_S)
            summary = tick(time.time() + 1)
            assert "shrink 2 → 1" in summary
            assert _workers(kube, namespace) == 1
            rig.wait_for(f"{victim} on {bad} gone", lambda: victim_uid not in {p["metadata"]["uid"]
                                                                 for p in kube.pods(namespace, "elastic")},
                         timeout=SAFETY_TIMEOUT_S)
            cond = _condition(kube, namespace)
            assert cond["reason"] == "Shrink" and "only 1 matching node(s)" in cond["message"]
            state = elastic_sync.state_of(kube.trainingspec(namespace, "elastic"))
            assert state["nodes"] == 1 and state["nodeFailures"] == {bad: 1}
            assert any(e.reason == "PodForceDeleted" and victim in e.message for e in events)
            assert any(e.reason == "Scaling" for e in events)
            # a spec edit re-plans with the elastic count, not resources.nodes
            reconcile(operator_kube, kube.trainingspec(namespace, "elastic"), config, post)
            assert _workers(kube, namespace) == 1

            rig.set_node_ready(bad, True)
            rig.wait_for(f"{bad} Ready", lambda: rig.node_ready(bad), timeout=SAFETY_TIMEOUT_S)
            summary = tick(time.time() + 2)
            assert "grow 1 → 2" in summary and _workers(kube, namespace) == 2
            rig.wait_for("2 running workers again", lambda: len(_running_pods(kube, namespace)) == 2,
                         timeout=SAFETY_TIMEOUT_S)
            assert _condition(kube, namespace)["reason"] == "Grow"

            # hang: rank 0 reports steps 10, 20, 30 ten seconds apart, then nothing for > max(10 x 1 s, 60 s)
            uids = {p["metadata"]["uid"] for p in kube.pods(namespace, "elastic")}
            t0 = time.time() + 10
            for i, step in enumerate((10, 20, 30)):
                kube.patch_status(namespace, "elastic", {"step": step})
                tick(t0 + 10 * i)
            tick(t0 + 20 + 59)
            assert not any(e.reason == "HangDetected" for e in events)
            tick(t0 + 20 + 61)
            hang = next(e for e in events if e.reason == "HangDetected")
            assert "no training step completed for 61s" in hang.message and "restart 1/10" in hang.message
            assert elastic_sync.state_of(kube.trainingspec(namespace, "elastic"))["restarts"] == 1
            rig.wait_for("workers recreated", lambda: len(_running_pods(kube, namespace)) == 2 and not (
                {p["metadata"]["uid"] for p in kube.pods(namespace, "elastic")} & uids), timeout=SAFETY_TIMEOUT_S)
        finally:
            rig.set_node_ready(bad, True)


def test_phase_plan_switches_after_the_boundary_is_committed(rig, namespace, operator_kube):
    install_crd(rig)
    kube = Kube(api_client(str(rig.kubeconfig)))
    events: list = []
    post = lambda body, event: events.append(event)  # noqa: E731
    config = OperatorConfig(image="kiln-trainer:rig")
    tuning = elastic_sync.Tuning(grace_s=0.0, grow_cooldown_s=0.0)
    body = _spec(rig, namespace)
    body["spec"]["resources"]["nodes"] = 1
    body["spec"]["elastic"]["plan"] = [{"untilStep": 10, "nodes": 1}, {"nodes": 2}]
    with rig.exclusive_gpus():
        _wait_gpu_nodes_free(rig, kube, namespace)
        rig.apply(body)
        reconcile(operator_kube, kube.trainingspec(namespace, "elastic"), config, post)
        rig.wait_for("1 running worker", lambda: len(_running_pods(kube, namespace)) == 1, timeout=SAFETY_TIMEOUT_S)
        # both GPU nodes are free, but the plan says 1 node until step 10 is committed
        kube.patch_status(namespace, "elastic", {"step": 12})
        summary = elastic_sync.tick(operator_kube, namespace, "elastic", config, post, time.time(),
                                    elastic_sync.listed(operator_kube, namespace, "elastic"), tuning)
        assert "steady at 1" in summary and "phase plan asks for 1" in summary and _workers(kube, namespace) == 1
        kube.patch_status(namespace, "elastic", {"lastCheckpoint": {"step": 10, "uri": "file:///tmp/ckpt/step-00000010/"}})
        summary = elastic_sync.tick(operator_kube, namespace, "elastic", config, post, time.time() + 1,
                                    elastic_sync.listed(operator_kube, namespace, "elastic"), tuning)
        assert "grow 1 → 2" in summary and "phase plan asks for 2 at committed step 10" in summary
        assert _workers(kube, namespace) == 2
        rig.wait_for("2 running workers", lambda: len(_running_pods(kube, namespace)) == 2, timeout=SAFETY_TIMEOUT_S)
