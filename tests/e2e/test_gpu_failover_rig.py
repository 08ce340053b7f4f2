"""Predictive failover on the rig: a GPU starts failing on the run's node → the run commits, leaves the node,
and continues from that commit on another node; status, Events and the goodput ledger say why.

Real: the apiserver, scheduler, training-operator, the operator (`kiln operator` as its shipped-RBAC
ServiceAccount, its own periodic tick deciding), the trainer (`kiln train`, a real process with the pod's
environment and the run's trainer ServiceAccount, reporting status itself), its commit on SIGTERM and its
resume. FAKE: only NVML (tests/fake_nvml/pynvml.py, first on the trainer's PYTHONPATH), whose GPU 0 the test
turns to 2 uncorrected ECC errors. kwok pods are not processes (the rig's one real node has no GPU), so, as in
test_suspend_rig, the test plays the kubelet: it starts the trainer of the pod the operator's job placed on a
kwok GPU node (KILN_NODE_NAME = that pod's spec.nodeName, as the downward API sets it), and delivers SIGTERM
when that pod is deleted. What this does not show: NVML on a real GPU, and the training-operator and kubelet
restarting a real container (the pod is recreated by the training-operator; its process is started here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.operator import (  # noqa: F401 - fixtures
    condition, events, get, ns, operator, running_pods, status, submit, wait_phase,
)
from tests.support.ranks import SAFETY_TIMEOUT_S, wait_until
from tests.support.trainers import Trainer, endless_run, no_trainer_outlives_its_test, pod_env  # noqa: F401 - fixtures

pytestmark = [pytest.mark.rig, pytest.mark.slow]

RUN = "gpu-failover"
FAKE_NVML = Path(__file__).resolve().parents[1] / "fake_nvml"


@pytest.fixture(scope="module")
def scope() -> str:
    """The cluster-wide install of test_operator_lifecycle's `ns`/`operator` fixtures."""
    return "cluster"


def show_gpu(path: Path, **gpu0) -> None:
    """What the FAKE NVML of one node shows: one GPU, healthy unless told otherwise."""
    path.write_text(json.dumps({"gpus": [{"name": "FAKE-H200", "temperature": 50, "slowdown": 90, **gpu0}]}))


def trainer_on(rig, namespace: str, pod: dict, workdir: Path) -> Trainer:
    """The trainer of `pod`, as its container would run on its node (a fresh /dev/shm: a new node's)."""
    workdir.mkdir(parents=True)
    nvml = workdir / "nvml.json"
    show_gpu(nvml)
    env = pod_env(rig, namespace, workdir, run=RUN)
    # the FAKE pynvml first on the path, in front of whatever the trainer imports kiln from
    path = os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH", "")) if p)
    env.update(KILN_NODE_NAME=pod["spec"]["nodeName"], FAKE_NVML_STATE=str(nvml), PYTHONPATH=path)
    trainer = Trainer(env, workdir / "out")
    trainer.nvml = nvml
    return trainer


def health(rig, namespace: str) -> list[tuple[str, str]]:
    return [(e["node"], e["state"]) for e in status(rig, namespace, RUN).get("gpuHealth") or []]


def test_a_failing_gpu_moves_the_run_off_its_node_at_a_commit_and_it_continues_elsewhere(rig, ns, operator,  # noqa: F811
                                                                                         tmp_path):
    ckpt = tmp_path / "ckpt"
    body = endless_run(rig, RUN, ckpt, interval_steps=100000)  # no periodic commit: the one saved is requested
    with rig.exclusive_gpus():
        submit(rig, ns, body)
        wait_phase(rig, ns, RUN, "Running")
        (pod_a,) = running_pods(rig, ns, RUN)
        node_a, uid_a = pod_a["spec"]["nodeName"], pod_a["metadata"]["uid"]
        a = trainer_on(rig, ns, pod_a, tmp_path / "a")
        alive_a = {"alive": lambda: a.proc.poll() is None, "context": a.tail}
        wait_until("the trainer's healthy report", lambda: health(rig, ns) == [(node_a, "Healthy")], **alive_a)
        wait_until("the operator's GPUHealthy condition",
                   lambda: condition(rig, ns, RUN, "GPUHealthy").get("reason") == "GPUsHealthy", **alive_a)

        show_gpu(a.nvml, ecc_uncorrected=2)  # GPU 0 of node A fails; the trainer reads it at its next probe
        # the operator's answer: the job keeps off node A, and the pod there is deleted (SIGTERM)
        wait_until(f"the pod on {node_a} deleted", lambda: not any(
            p["metadata"]["uid"] == uid_a for p in running_pods(rig, ns, RUN)), **alive_a)
        assert health(rig, ns) == [(node_a, "Failing")]
        job = get(rig, ns, "pytorchjob", RUN)
        terms = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [node_a]}
                   in t["matchExpressions"] for t in terms), terms
        moving = rig.wait_for("GPUHealthy while moving", lambda: (c := condition(rig, ns, RUN, "GPUHealthy"))
                              .get("reason") == "MovingOffNode" and c, timeout=SAFETY_TIMEOUT_S)
        assert moving["status"] == "False" and node_a in moving["message"] and "GPU 0" in moving["message"]
        assert a.sigterm() == 0, a.tail()  # the kubelet's SIGTERM: the trainer commits and exits
        saved = a.records()[-1]["step"]
        assert (ckpt / "latest").read_text().strip() == f"step-{saved:08d}", a.tail()

        pod_b = rig.wait_for("the worker recreated on another node", lambda: next(
            (p for p in running_pods(rig, ns, RUN) if p["metadata"]["uid"] != uid_a), None), timeout=SAFETY_TIMEOUT_S)
        node_b = pod_b["spec"]["nodeName"]
        assert node_b != node_a and node_b in rig.gpu_nodes
        b = trainer_on(rig, ns, pod_b, tmp_path / "b")
        b.wait_step(saved + 2)
        # the operator sees the trainer report from node B: the move is done, and the ledger priced it
        done = rig.wait_for("GPUHealthy after the move", lambda: (c := condition(rig, ns, RUN, "GPUHealthy"))
                            .get("reason") == "GPUsHealthy" and c, timeout=SAFETY_TIMEOUT_S)
        assert f"moved off {node_a}" in done["message"] and "uncorrected ECC" in done["message"]
        ledger = rig.wait_for("the failover in the goodput ledger", lambda: (s := status(rig, ns, RUN)).get(
            "goodputDetail", {}).get("lostSeconds", {}).get("gpuFailover", 0) > 0 and s, timeout=SAFETY_TIMEOUT_S)
        assert health(rig, ns) == [(node_b, "Healthy")]
        assert b.sigterm() == 0, b.tail()

    resumed = b.records()
    assert resumed[0]["step"] == saved + 1, [r["step"] for r in resumed]  # continued from the commit
    said = {e["reason"]: e["message"] for e in events(rig, ns, RUN)}
    assert node_a in said["GPUFailover"] and "GPU 0 (FAKE-H200): 2 uncorrected ECC error(s)" in said["GPUFailover"]
    assert f"off {node_a}" in said["GPUFailoverDone"] and node_b in said["GPUFailoverDone"]
    detail = ledger["goodputDetail"]
    assert detail["productiveSeconds"] + sum(detail["lostSeconds"].values()) <= detail["wallSeconds"] + 0.5
