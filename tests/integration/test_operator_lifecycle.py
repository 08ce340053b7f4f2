"""The kiln operator on the rig, running as each shipped least-privilege ServiceAccount: cluster-wide
(manifests/rbac, as `kubectl apply -k` installs it) and namespaced (the Helm chart with watchNamespaces).

Real kube-apiserver, kube-scheduler, kube-controller-manager (garbage collection), the Kubeflow
training-operator (PyTorchJob → pods) and kwok GPU nodes (pods run, fail or succeed on demand).
"""

from __future__ import annotations

import json

import pytest
import yaml

from kiln.cli.main import main
from tests.support.operator import (  # noqa: F401 - fixtures
    IMAGE, ROOT, condition, events, get, items, ns, operator, patch_spec, running_pods, scope, status, submit,
    wait_phase,
)
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.specs import small_run

pytestmark = pytest.mark.rig

SAMPLES = ROOT / "manifests" / "samples"


def test_sample_becomes_a_running_pytorchjob_then_delete_removes_everything(rig, ns, operator, capsys):
    with rig.exclusive_gpus():
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials", "namespace": ns},
                  "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "not-in-any-kiln-object"}}
        rig.apply(secret)
        rig.kubectl("apply", "-n", ns, "-f", str(SAMPLES / "gpu-single-node.yaml"))
        name = "llama-1b-single-node"
        ts = get(rig, ns, "trainingspec", name)
        job = rig.wait_for("PyTorchJob", lambda: get(rig, ns, "pytorchjob", name), timeout=SAFETY_TIMEOUT_S)
        cm = get(rig, ns, "configmap", f"{name}-spec")

        assert job["metadata"]["ownerReferences"][0]["uid"] == ts["metadata"]["uid"]
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        container = pod["containers"][0]
        assert job["spec"]["nprocPerNode"] == "8" and container["image"] == IMAGE
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert "not-in-any-kiln-object" not in json.dumps(job) + json.dumps(cm)
        resolved = yaml.safe_load(cm["data"]["spec.yaml"])["spec"]
        assert resolved["model"]["dim"] == 2048 and resolved["resources"]["processesPerNode"] == 8

        final = wait_phase(rig, ns, name, "Running")
        assert final["nodes"] == 1 and final["observedGeneration"] == ts["metadata"]["generation"]
        (worker,) = running_pods(rig, ns, name)
        assert worker["spec"]["nodeName"] in rig.gpu_nodes
        assert any(e["reason"] == "Running" for e in events(rig, ns, name))

        kubeconfig = str(rig.kubeconfig)
        assert main(["status", name, "-n", ns, "--kubeconfig", kubeconfig]) == 0
        out = capsys.readouterr().out
        assert name in out and "Running" in out and "SpecAccepted" in out
        assert main(["wait", name, "-n", ns, "--kubeconfig", kubeconfig, "--for", "running",
                     "--timeout", f"{SAFETY_TIMEOUT_S}s"]) == 0

        rig.kubectl("delete", "trainingspec", name, "-n", ns)
        for kind, obj in [("pytorchjob", name), ("configmap", f"{name}-spec"), ("serviceaccount", f"{name}-trainer"),
                          ("role", f"{name}-trainer"), ("rolebinding", f"{name}-trainer")]:
            rig.wait_for(f"{kind}/{obj} deleted", lambda: get(rig, ns, kind, obj) is None, timeout=SAFETY_TIMEOUT_S)
        rig.wait_for("pods deleted", lambda: not items(rig, ns, "pods", f"kiln.dev/trainingspec={name}"),
                     timeout=SAFETY_TIMEOUT_S)


def test_pod_failure_restarts_then_fails_as_the_pytorchjob_says(rig, ns, operator):
    name = "fails"
    submit(rig, ns, small_run(name, resources={"nodes": 2}))
    wait_phase(rig, ns, name, "Running")
    rig.wait_for("both pods running", lambda: len(running_pods(rig, ns, name)) == 2, timeout=SAFETY_TIMEOUT_S)
    # 137 (killed): retryable under restartPolicy ExitCode → the training-operator recreates the pod
    killed = get(rig, ns, "pod", f"{name}-worker-0")["metadata"]["uid"]
    rig.fail_pod(ns, f"{name}-worker-0", exit_code=137)
    rig.wait_for("a restart counted", lambda: status(rig, ns, name).get("restarts", 0) >= 1, timeout=SAFETY_TIMEOUT_S)
    assert any(e["reason"] == "Restarting" and e["type"] == "Warning" for e in events(rig, ns, name))
    # the recreated worker-0 itself running (worker-1 ran throughout): the next failure must hit it, not the
    # killed pod the training-operator is still replacing
    rig.wait_for("worker-0 back", lambda: any(
        p["metadata"]["name"] == f"{name}-worker-0" and p["metadata"]["uid"] != killed
        for p in running_pods(rig, ns, name)), timeout=SAFETY_TIMEOUT_S)
    wait_phase(rig, ns, name, "Running")
    # 1: a permanent error → the job fails, and so does the run
    rig.fail_pod(ns, f"{name}-worker-0", exit_code=1)
    final = wait_phase(rig, ns, name, "Failed")
    assert next(c for c in final["conditions"] if c["type"] == "Failed")["status"] == "True"
    # the surviving worker would hold its GPU until its rendezvous times out: the operator stops it, and
    # keeps the failed pod (its log says why)
    rig.wait_for("the surviving worker stopped", lambda: not running_pods(rig, ns, name), timeout=SAFETY_TIMEOUT_S)
    stopped = [e for e in events(rig, ns, name) if e["reason"] == "PodsStopped"]
    assert stopped and f"{name}-worker-1" in stopped[0]["message"], [e["reason"] for e in events(rig, ns, name)]
    assert get(rig, ns, "pod", f"{name}-worker-0")["status"]["phase"] == "Failed"
    kubeconfig = str(rig.kubeconfig)
    assert main(["wait", name, "-n", ns, "--kubeconfig", kubeconfig, "--timeout", f"{SAFETY_TIMEOUT_S}s"]) == 1


def test_success_and_wait_exit_codes(rig, ns, operator):
    name = "succeeds"
    submit(rig, ns, small_run(name))
    wait_phase(rig, ns, name, "Running")
    kubeconfig = str(rig.kubeconfig)
    assert main(["wait", name, "-n", ns, "--kubeconfig", kubeconfig, "--timeout", "1s", "--interval", "0.2"]) == 2
    rig.succeed_pod(ns, f"{name}-worker-0")
    assert main(["wait", name, "-n", ns, "--kubeconfig", kubeconfig, "--for", "succeeded",
                 "--timeout", f"{SAFETY_TIMEOUT_S}s"]) == 0
    # a finished run's pod stays (Completed, holding nothing) so `kiln logs` can read it
    assert get(rig, ns, "pod", f"{name}-worker-0")["status"]["phase"] == "Succeeded"
    assert not any(e["reason"] == "PodsStopped" for e in events(rig, ns, name))


def test_suspend_releases_every_gpu_and_resume_brings_them_back(rig, ns, operator):
    name = "pausable"
    submit(rig, ns, small_run(name, suspend=True, resources={"nodes": 2}))
    wait_phase(rig, ns, name, "Suspended")
    job = get(rig, ns, "pytorchjob", name)
    assert job["spec"]["runPolicy"]["suspend"] is True
    assert not items(rig, ns, "pods", f"kiln.dev/trainingspec={name}")

    patch_spec(rig, ns, name, {"suspend": False})
    rig.wait_for("2 pods running", lambda: len(running_pods(rig, ns, name)) == 2, timeout=SAFETY_TIMEOUT_S)
    wait_phase(rig, ns, name, "Running")

    patch_spec(rig, ns, name, {"suspend": True})
    wait_phase(rig, ns, name, "Suspended")
    rig.wait_for("no pods", lambda: not items(rig, ns, "pods", f"kiln.dev/trainingspec={name}"),
                 timeout=SAFETY_TIMEOUT_S)
    assert get(rig, ns, "pytorchjob", name)["spec"]["runPolicy"]["suspend"] is True


def test_operator_restart_creates_no_duplicates(rig, ns, operator):
    name = "survivor"
    submit(rig, ns, small_run(name, elastic={"maxNodes": 2}))
    wait_phase(rig, ns, name, "Running")
    job = get(rig, ns, "pytorchjob", name)

    operator.stop()
    patch_spec(rig, ns, name, {"resources": {"nodes": 2}})  # changed while no operator runs
    operator.start()
    rig.wait_for("replicas 2", lambda: get(rig, ns, "pytorchjob", name)["spec"]["pytorchReplicaSpecs"]["Worker"]
                 ["replicas"] == 2, timeout=SAFETY_TIMEOUT_S)
    selector = f"kiln.dev/trainingspec={name}"
    assert [j["metadata"]["uid"] for j in items(rig, ns, "pytorchjobs", selector)] == [job["metadata"]["uid"]]
    assert len(items(rig, ns, "configmaps", selector)) == 1

    # a restart with nothing to do writes nothing
    before = get(rig, ns, "pytorchjob", name)["metadata"]["generation"], get(rig, ns, "configmap",
                                                                             f"{name}-spec")["metadata"]
    operator.stop()
    operator.start()
    rig.wait_for("the resume handler ran", lambda: f"{name}: Applied" in operator.log_since_start(),
                 timeout=SAFETY_TIMEOUT_S)
    after = get(rig, ns, "pytorchjob", name)["metadata"]["generation"], get(rig, ns, "configmap",
                                                                            f"{name}-spec")["metadata"]
    assert before[0] == after[0] and before[1]["resourceVersion"] == after[1]["resourceVersion"]


def test_change_the_job_cannot_absorb_is_refused_not_half_applied(rig, ns, operator):
    name = "steady"
    submit(rig, ns, small_run(name))
    wait_phase(rig, ns, name, "Running")
    job_gen = get(rig, ns, "pytorchjob", name)["metadata"]["generation"]
    cm_rv = get(rig, ns, "configmap", f"{name}-spec")["metadata"]["resourceVersion"]

    patch_spec(rig, ns, name, {"model": {"preset": "small"}})
    cond = rig.wait_for("SpecAccepted False", lambda: (c := condition(rig, ns, name, "SpecAccepted")).get(
        "status") == "False" and c, timeout=SAFETY_TIMEOUT_S)
    assert cond["reason"] == "ImmutableFieldChanged" and "spec.model.preset" in cond["message"]
    assert any(e["reason"] == "ImmutableFieldChanged" for e in events(rig, ns, name))
    assert get(rig, ns, "pytorchjob", name)["metadata"]["generation"] == job_gen
    assert get(rig, ns, "configmap", f"{name}-spec")["metadata"]["resourceVersion"] == cm_rv
    assert status(rig, ns, name)["phase"] == "Running"

    patch_spec(rig, ns, name, {"model": {"preset": "tiny"}})
    rig.wait_for("accepted again", lambda: condition(rig, ns, name, "SpecAccepted").get("status") == "True",
                 timeout=SAFETY_TIMEOUT_S)


def test_missing_secret_is_reported_and_the_run_starts_once_it_exists(rig, ns, operator):
    # The shipped RBAC reads no Secrets (the pod reports a missing one: ContainerConfigError). An admin who
    # wants the run held back before any pod grants `get` on the named Secret, and only that one.
    name = "needs-secret"
    grant = {"apiVersion": "rbac.authorization.k8s.io/v1", "metadata": {"name": "kiln-reads-late-secret",
                                                                       "namespace": ns}}
    rig.apply({**grant, "kind": "Role", "rules": [{"apiGroups": [""], "resources": ["secrets"],
                                                   "resourceNames": ["late-secret"], "verbs": ["get"]}]})
    rig.apply({**grant, "kind": "RoleBinding",
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kiln-reads-late-secret"},
               "subjects": [{"kind": "ServiceAccount", "name": operator.service_account, "namespace": ns}]})
    submit(rig, ns, small_run(name, checkpoint={"uri": "s3://kiln/needs-secret/", "endpoint": rig.s3_endpoint,
                                                "credentialsSecret": "late-secret"}))
    cond = rig.wait_for("SecretMissing", lambda: (c := condition(rig, ns, name, "SpecAccepted")).get(
        "reason") == "SecretMissing" and c, timeout=SAFETY_TIMEOUT_S)
    assert "late-secret" in cond["message"] and "does not exist" in cond["message"]
    assert any(e["reason"] == "SecretMissing" for e in events(rig, ns, name))
    assert get(rig, ns, "pytorchjob", name) is None  # never a half-created run
    rig.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "late-secret", "namespace": ns},
               "stringData": {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}})
    rig.wait_for("job after the Secret", lambda: get(rig, ns, "pytorchjob", name), timeout=SAFETY_TIMEOUT_S)
    rig.wait_for("accepted", lambda: condition(rig, ns, name, "SpecAccepted").get("status") == "True",
                 timeout=SAFETY_TIMEOUT_S)


def test_unschedulable_gpus_are_reported(rig, ns, operator):
    name = "too-big"
    with rig.exclusive_gpus():
        submit(rig, ns, small_run(name, resources={"nodes": len(rig.gpu_nodes) + 1,
                                                   "gpusPerNode": rig.gpus_per_node},
                                  training={"globalBatchSize": 8 * 3 * 8}))
        cond = rig.wait_for("PodsScheduled False", lambda: (c := condition(rig, ns, name, "PodsScheduled")).get(
            "status") == "False" and c, timeout=SAFETY_TIMEOUT_S)
        assert "nvidia.com/gpu" in cond["message"]
        assert any(e["reason"] == "Unschedulable" for e in events(rig, ns, name))
        rig.kubectl("delete", "trainingspec", name, "-n", ns)
        rig.wait_for("pods gone", lambda: not items(rig, ns, "pods", f"kiln.dev/trainingspec={name}"),
                     timeout=SAFETY_TIMEOUT_S)


def test_trainer_may_patch_only_its_own_status(rig, ns, operator):
    name = "reporter"
    submit(rig, ns, small_run(name, suspend=True))
    rig.wait_for("trainer identity", lambda: get(rig, ns, "rolebinding", f"{name}-trainer"), timeout=SAFETY_TIMEOUT_S)
    kubeconfig = rig.kubeconfig_for_service_account(ns, f"{name}-trainer")

    def as_trainer(*args):
        return rig.kubectl(*args, "-n", ns, kubeconfig=kubeconfig, check=False)

    ok = as_trainer("patch", "trainingspec", name, "--subresource=status", "--type", "merge",
                    "-p", json.dumps({"status": {"step": 10, "tokensPerSecond": 1234.5}}))
    assert ok.returncode == 0, ok.stderr
    assert status(rig, ns, name)["step"] == 10
    denied = as_trainer("patch", "trainingspec", name, "--type", "merge", "-p", '{"spec":{"suspend":false}}')
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    other = as_trainer("patch", "trainingspec", "steady", "--subresource=status", "--type", "merge",
                       "-p", '{"status":{"step":1}}')
    assert other.returncode != 0 and "forbidden" in other.stderr
    assert as_trainer("get", "pods").returncode != 0


def test_invalid_spec_is_refused_by_kiln_submit_and_the_apiserver(rig, ns, operator, tmp_path, capsys):
    bad = small_run("bad-split", parallelism={"tensor": 2})  # 1 GPU per node: tensor 2 cannot fit
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["submit", str(path), "-n", ns, "--kubeconfig", str(rig.kubeconfig)]) == 1
    assert "spec.parallelism.tensor" in capsys.readouterr().err
    proc = rig.kubectl("apply", "-n", ns, "-f", str(path), check=False)
    assert proc.returncode != 0 and "spec.parallelism.tensor" in proc.stderr
    assert "must divide the processes per node" in proc.stderr


def test_the_elastic_loop_acts_under_this_service_account(rig, ns, operator):
    # The operator's own periodic tick (no test calls it): a 1-node run that may grow to 2 grows once two
    # matching nodes have a free GPU. Namespaced, the loop reads pods only in its namespaces and nodes
    # cluster-wide; before, it listed every namespace's pods and got 403 on each tick.
    name = "grows"
    submit(rig, ns, small_run(name, elastic={"minNodes": 1, "maxNodes": 2}))
    cond = rig.wait_for("Elastic Grow", lambda: (c := condition(rig, ns, name, "Elastic")).get("reason") == "Grow"
                        and c, timeout=SAFETY_TIMEOUT_S)
    assert "grow 1 → 2" in cond["message"]
    rig.wait_for("2 workers", lambda: get(rig, ns, "pytorchjob", name)["spec"]["pytorchReplicaSpecs"]["Worker"]
                 ["replicas"] == 2, timeout=SAFETY_TIMEOUT_S)
    assert any(e["reason"] == "Scaling" for e in events(rig, ns, name))
    assert "periodic tick failed" not in operator.log_since_start()
