"""The rig's control plane: training-operator → pods → kube-scheduler → kwok GPU nodes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kubeflow.training import (
    KubeflowOrgV1PyTorchJob, KubeflowOrgV1PyTorchJobSpec, KubeflowOrgV1ReplicaSpec, KubeflowOrgV1RunPolicy,
    TrainingClient,
)
from kubernetes import client as k8s

from tests.rig import build, versions
from tests.support.ranks import SAFETY_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.rig

GPU = "nvidia.com/gpu"


def pytorch_job(name: str, workers: int, gpus: int, product: str) -> KubeflowOrgV1PyTorchJob:
    container = k8s.V1Container(
        name="pytorch",  # the training-operator requires a container of this name
        image="kiln-trainer:test",
        command=["torchrun", "train.py"],
        resources=k8s.V1ResourceRequirements(limits={GPU: str(gpus)}, requests={GPU: str(gpus)}),
    )
    template = k8s.V1PodTemplateSpec(
        spec=k8s.V1PodSpec(containers=[container], node_selector={"nvidia.com/gpu.product": product})
    )
    return KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=name),
        spec=KubeflowOrgV1PyTorchJobSpec(
            run_policy=KubeflowOrgV1RunPolicy(clean_pod_policy="None"),
            pytorch_replica_specs={
                "Worker": KubeflowOrgV1ReplicaSpec(replicas=workers, restart_policy="OnFailure", template=template)
            },
        ),
    )


def pods_of(rig, namespace: str, job: str) -> list[dict]:
    out = rig.kubectl("get", "pods", "-n", namespace, "-l", f"training.kubeflow.org/job-name={job}", "-o", "json")
    return json.loads(out.stdout)["items"]


def condition(pod: dict, kind: str) -> dict:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == kind), {})


@pytest.fixture
def training(rig, namespace):
    return TrainingClient(config_file=str(rig.kubeconfig), namespace=namespace)


def test_versions_are_the_pinned_release(rig):
    info = json.loads(rig.kubectl("version", "-o", "json").stdout)
    assert info["clientVersion"]["gitVersion"] == versions.KUBERNETES
    assert info["serverVersion"]["gitVersion"] == versions.KUBERNETES


def test_gpu_jobs_are_placed_and_excess_stays_pending(rig, namespace, training):
    with rig.exclusive_gpus():
        # Other tests' GPU pods may still be terminating; this test needs all 16 GPUs.
        rig.wait_for("every GPU free", lambda: not rig.gpus_in_use(), timeout=SAFETY_TIMEOUT_S)
        training.create_job(pytorch_job("fits", workers=2, gpus=8, product=rig.gpu_product))
        rig.wait_for("PyTorchJob fits Running", lambda: training.is_job_running("fits"), timeout=SAFETY_TIMEOUT_S)
        pods = rig.wait_for(
            "2 Running pods of fits",
            lambda: (p := pods_of(rig, namespace, "fits")) and len(p) == 2
            and all(x["status"].get("phase") == "Running" for x in p) and p,
            timeout=SAFETY_TIMEOUT_S,
        )
        # 8 GPUs each: the scheduler must put them on two different GPU nodes.
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(rig.gpu_nodes)

        # Every GPU is taken now: another job's pod cannot be placed.
        training.create_job(pytorch_job("waits", workers=1, gpus=8, product=rig.gpu_product))
        pending = rig.wait_for(
            "an unschedulable pod of waits",
            lambda: [p for p in pods_of(rig, namespace, "waits")
                     if condition(p, "PodScheduled").get("reason") == "Unschedulable"],
            timeout=SAFETY_TIMEOUT_S,
        )
        assert GPU in condition(pending[0], "PodScheduled")["message"]
        assert pending[0]["status"]["phase"] == "Pending"
        assert not training.is_job_running("waits")

        # A job asking for a GPU product the cluster does not have is never placed either.
        training.create_job(pytorch_job("wrong-gpu", workers=1, gpus=1, product="NVIDIA-B300"))
        rig.wait_for(
            "an unschedulable pod of wrong-gpu",
            lambda: [p for p in pods_of(rig, namespace, "wrong-gpu")
                     if condition(p, "PodScheduled").get("reason") == "Unschedulable"],
            timeout=SAFETY_TIMEOUT_S,
        )

        # Freeing the GPUs lets the waiting job run: it was pending for GPUs, nothing else.
        training.delete_job("fits")
        rig.wait_for("PyTorchJob waits Running", lambda: training.is_job_running("waits"), timeout=SAFETY_TIMEOUT_S)
        training.delete_job("waits")
        training.delete_job("wrong-gpu")


def test_training_operator_sees_pods_fail_and_succeed(rig, namespace, training):
    for name in ("will-fail", "will-succeed"):
        job = pytorch_job(name, workers=1, gpus=1, product=rig.gpu_product)
        job.spec.pytorch_replica_specs["Worker"].restart_policy = "Never"
        training.create_job(job)
    for name in ("will-fail", "will-succeed"):
        rig.wait_for(f"PyTorchJob {name} Running", lambda n=name: training.is_job_running(n), timeout=SAFETY_TIMEOUT_S)
    rig.fail_pod(namespace, "will-fail-worker-0", exit_code=137)
    rig.succeed_pod(namespace, "will-succeed-worker-0")
    rig.wait_for("PyTorchJob will-fail Failed", lambda: training.is_job_failed("will-fail"), timeout=SAFETY_TIMEOUT_S)
    rig.wait_for("PyTorchJob will-succeed Succeeded", lambda: training.is_job_succeeded("will-succeed"),
                 timeout=SAFETY_TIMEOUT_S)


def test_webhook_rejects_an_invalid_pytorchjob(rig, namespace, training):
    job = pytorch_job("invalid", workers=1, gpus=1, product=rig.gpu_product)
    job.spec.pytorch_replica_specs["Worker"].template.spec.containers[0].name = "trainer"
    with pytest.raises(RuntimeError) as err:
        training.create_job(job)
    # Refused by the training-operator's own validating webhook, called by the apiserver by URL.
    assert 'denied the request' in str(err.value)
    assert "must have at least one container with name pytorch" in str(err.value)
    assert rig.kubectl("get", "pytorchjob", "invalid", "-n", namespace, check=False).returncode != 0


def test_pods_can_be_made_to_fail_or_succeed(rig, namespace):
    def pod(name: str) -> str:
        return json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}]},
        })

    for name in ("ok", "boom"):
        rig.kubectl("apply", "-f", "-", input=pod(name))
    for name in ("ok", "boom"):
        rig.wait_for(f"pod {name} Running", lambda n=name: phase(rig, namespace, n) == "Running",
                     timeout=SAFETY_TIMEOUT_S)
    rig.succeed_pod(namespace, "ok")
    rig.fail_pod(namespace, "boom", exit_code=3)
    rig.wait_for("pod ok Succeeded", lambda: phase(rig, namespace, "ok") == "Succeeded", timeout=SAFETY_TIMEOUT_S)
    rig.wait_for("pod boom Failed", lambda: phase(rig, namespace, "boom") == "Failed", timeout=SAFETY_TIMEOUT_S)
    state = json.loads(rig.kubectl("get", "pod", "boom", "-n", namespace, "-o", "json").stdout)
    assert state["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def phase(rig, namespace: str, name: str) -> str:
    return rig.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}").stdout


def test_node_can_be_made_not_ready_and_ready_again(rig):
    node = rig.gpu_nodes[-1]
    with rig.exclusive_gpus():
        try:
            rig.set_node_ready(node, False)
            rig.wait_for(f"{node} NotReady", lambda: not rig.node_ready(node), timeout=SAFETY_TIMEOUT_S)
        finally:
            rig.set_node_ready(node, True)
        rig.wait_for(f"{node} Ready", lambda: rig.node_ready(node), timeout=SAFETY_TIMEOUT_S)


def test_service_account_kubeconfig_acts_as_that_account(rig, namespace):
    rig.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    rig.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace)
    rig.kubectl("create", "rolebinding", "reader", "--role=pod-reader", f"--serviceaccount={namespace}:reader",
                "-n", namespace)
    kubeconfig = rig.kubeconfig_for_service_account(namespace, "reader")
    who = json.loads(rig.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"
    assert rig.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig).returncode == 0
    # RBAC is enforced: the same account may not read secrets, nor pods elsewhere.
    denied = rig.kubectl("get", "secrets", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    impersonated = rig.kubectl("get", "pods", "-n", "default", check=False,
                               as_user=f"system:serviceaccount:{namespace}:reader")
    assert impersonated.returncode != 0 and "forbidden" in impersonated.stderr
    with pytest.raises(subprocess.CalledProcessError) as err:
        rig.kubectl("create", "configmap", "x", "-n", namespace, kubeconfig=kubeconfig)
    assert "forbidden" in err.value.stderr


def test_helm_checks_kube_version_against_the_rig(rig, namespace, tmp_path):
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n"
        "data: {kube: {{ .Capabilities.KubeVersion.Version | quote }}}\n"
    )
    helm = [str(rig.bin / "helm"), "--kubeconfig", str(rig.kubeconfig), "-n", namespace]

    def install(constraint: str) -> subprocess.CompletedProcess:
        (chart / "Chart.yaml").write_text(
            f"apiVersion: v2\nname: probe\nversion: 0.1.0\nkubeVersion: '{constraint}'\n"
        )
        return subprocess.run(helm + ["install", "probe", str(chart)], capture_output=True, text=True, check=False)

    too_new = install(">=1.99.0-0")
    assert too_new.returncode != 0 and "incompatible with Kubernetes v1.36" in too_new.stderr
    ok = install(">=1.34.0-0")
    assert ok.returncode == 0, ok.stderr
    got = rig.kubectl("get", "configmap", "probe", "-n", namespace, "-o", "jsonpath={.data.kube}").stdout
    assert got == versions.KUBERNETES


def test_second_build_compiles_nothing(rig, tmp_path):
    """A second build of a built rig runs no Go toolchain step (only `go env GOVERSION`, part of the cache key)
    and leaves every binary and stamp as it was: shown by what it ran, not by how long it took."""
    real_go = shutil.which("go")
    assert real_go, "the rig fixture built with Go on PATH"
    calls = tmp_path / "go-calls"
    shim = tmp_path / "bin" / "go"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\nexec {shlex.quote(real_go)} "$@"\n')
    shim.chmod(0o755)
    outputs = sorted(p for p in build.rig_dir().rglob("*") if p.is_file() and p.parent.name in ("bin", "stamps"))
    assert {p.name for p in outputs} >= {b for n in versions.BUILD_ORDER for b in build.binary_names(n)}
    before = {p: p.stat().st_mtime_ns for p in outputs}
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"}
    script = "import json; from tests.rig import build; print(json.dumps(build.build()))"
    proc = subprocess.run([sys.executable, "-c", script],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spent = json.loads(proc.stdout)
    assert spent == {name: 0 for name in versions.BUILD_ORDER}
    ran = calls.read_text().splitlines() if calls.exists() else []
    assert ran and set(ran) == {"env GOVERSION"}, ran  # the shim is on the path; no build, mod or download ran
    assert f"all {len(versions.BUILD_ORDER)} components cached" in proc.stderr, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in outputs} == before
