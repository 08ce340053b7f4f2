"""The kiln operator on the rig, running as each shipped least-privilege ServiceAccount: cluster-wide
(manifests/rbac, as `kubectl apply -k` installs it) and namespaced (the Helm chart with watchNamespaces).

Real kube-apiserver, kube-scheduler, kube-controller-manager (garbage collection), the Kubeflow
training-operator (PyTorchJob → pods) and kwok GPU nodes (pods run, fail or succeed on demand).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from kiln.cli.main import main

from tests.distributed.ranks import SAFETY_TIMEOUT_S, free_port, wait_until
from tests.rig.install import install_crd, render, scratch_namespace  # noqa: F401 (re-exported)

pytestmark = pytest.mark.rig

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "manifests" / "rbac"
SAMPLES = ROOT / "manifests" / "samples"
IMAGE = "kiln-trainer:rig"


class Operator:
    """`kiln operator` as a child process, authenticated as an operator ServiceAccount (its kubeconfig).

    lease: the leader election Lease ([NAMESPACE/]NAME) the ServiceAccount may use; env: extra settings
    (POD_ID names the operator in the Lease)."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path, lease: str = "kiln-operator",
                 env: dict[str, str] | None = None):
        self.kubeconfig, self.namespace, self.log, self.lease = kubeconfig, namespace, log, lease
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.port, self.metrics_port = free_port(), free_port()

    def start(self) -> None:
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        env = {**os.environ, "KILN_TRAINER_IMAGE": IMAGE, "PYTHONUNBUFFERED": "1",
               "KILN_METRICS_PORT": str(self.metrics_port), **self.env}  # several operators may run here
        env.pop("KUBECONFIG", None)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.cli.main", "operator", "--kubeconfig", str(self.kubeconfig),
                 "-n", self.namespace, "--health-port", str(self.port), "--leader-lease", self.lease],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_until("the operator's /healthz", self.healthy, alive=lambda: self.proc.poll() is None, context=self.tail)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def reconciles(self, handler: str, outcome: str = "ok") -> float:
        """kiln_operator_reconciles_total{handler, outcome} from the operator's /metrics (0 before any)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        line = f'kiln_operator_reconciles_total{{handler="{handler}",outcome="{outcome}"}} '
        return next((float(l.split()[-1]) for l in text.splitlines() if l.startswith(line)), 0.0)

    def log_since_start(self) -> str:
        return self.log.read_text()[self.log_offset:]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:]) if self.log.exists() else ""


@contextmanager
def shipped_rbac(rig, ns: str, scope: str):
    """The operator's shipped RBAC, bound to a ServiceAccount in `ns`; yields (ServiceAccount, Lease name).

    cluster: manifests/rbac as `kubectl apply -k manifests/cluster-wide` installs it (a ClusterRoleBinding;
    the leader Role in `ns` instead of kiln-system). namespaced: the Helm chart rendered with watchNamespaces=[ns] (the
    ClusterRole bound in `ns` only, its cluster-scoped rules cluster-wide, the leader Role in `ns`)."""
    cluster_scoped: list[tuple[str, str]] = []
    if scope == "cluster":
        sa, lease = "kiln-operator", "kiln-operator"
        paths = [*sorted(RBAC.glob("operator-*.yaml")), RBAC.parent / "cluster-wide" / "operator-clusterrolebinding.yaml"]
        objs = [o for path in paths for o in yaml.safe_load_all(path.read_text())]
        for obj in objs:
            if obj["kind"] == "ClusterRoleBinding":
                obj["metadata"]["name"] = f"kiln-operator-{ns}"
            if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
                obj["metadata"]["namespace"] = ns
            for subject in obj.get("subjects") or []:
                subject["namespace"] = ns
    else:
        release = f"kiln-{ns[-6:]}"
        objs = [o for o in render(rig, "--set", f"watchNamespaces={{{ns}}}", release=release, namespace=ns)
                if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
                and not o["metadata"]["name"].endswith("-trainer")]
        sa = lease = f"{release}-operator"
    for obj in objs:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            cluster_scoped.append((obj["kind"].lower(), obj["metadata"]["name"]))
        rig.apply(obj)
    try:
        yield sa, lease
    finally:
        for kind, name in cluster_scoped:
            if name != "kiln-operator":  # the ClusterRole shared by every cluster-wide test install
                rig.kubectl("delete", kind, name, check=False)


@pytest.fixture(scope="module", params=["cluster", "namespaced"])
def scope(request) -> str:
    return request.param


@contextmanager
def running_operator(rig, ns: str, scope: str, log_dir: Path):
    """The operator with exactly a shipped RBAC (shipped_rbac), as its ServiceAccount in `ns`."""
    install_crd(rig)
    with shipped_rbac(rig, ns, scope) as (sa, lease):
        op = Operator(rig.kubeconfig_for_service_account(ns, sa), ns, log_dir / "operator.log",
                      lease=f"{ns}/{lease}")
        op.service_account = sa
        op.start()
        try:
            yield op
        finally:
            op.stop()
            print(f"--- operator log (tail) ---\n{op.tail()}")


@pytest.fixture(scope="module")
def ns(rig, scope):
    with scratch_namespace(rig, f"kiln-op-{scope[:2]}") as name:
        yield name


@pytest.fixture(scope="module")
def operator(rig, ns, scope, tmp_path_factory):
    with running_operator(rig, ns, scope, tmp_path_factory.mktemp("operator")) as op:
        yield op


def get(rig, ns: str, kind: str, name: str) -> dict | None:
    proc = rig.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def items(rig, ns: str, kind: str, selector: str) -> list[dict]:
    return json.loads(rig.kubectl("get", kind, "-n", ns, "-l", selector, "-o", "json").stdout)["items"]


def status(rig, ns: str, name: str) -> dict:
    return (get(rig, ns, "trainingspec", name) or {}).get("status") or {}


def condition(rig, ns: str, name: str, ctype: str) -> dict:
    return next((c for c in status(rig, ns, name).get("conditions") or [] if c["type"] == ctype), {})


def events(rig, ns: str, name: str) -> list[dict]:
    out = rig.kubectl("get", "events", "-n", ns, "--field-selector",
                      f"involvedObject.kind=TrainingSpec,involvedObject.name={name}", "-o", "json").stdout
    return json.loads(out)["items"]


def wait_phase(rig, ns: str, name: str, phase: str, timeout: float = SAFETY_TIMEOUT_S) -> dict:
    return rig.wait_for(f"{name} phase {phase} (now {status(rig, ns, name).get('phase')})",
                        lambda: (s := status(rig, ns, name)).get("phase") == phase and s, timeout=timeout)


def small_run(name: str, **spec) -> dict:
    """A tiny GPU run (1 GPU per node) so that several fit on the rig's kwok nodes at once."""
    body = {"model": {"preset": "tiny"}, "data": {"uri": "synthetic"},
            "training": {"steps": 100, "globalBatchSize": 8, "microBatchSize": 1},
            "resources": {"nodes": 1, "gpusPerNode": 1, "gpuType": "NVIDIA-H200"},
            "checkpoint": {"uri": "file:///ckpt/"}}
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name}, "spec": body}


def submit(rig, ns: str, body: dict) -> None:
    rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))


def patch_spec(rig, ns: str, name: str, spec: dict) -> None:
    rig.kubectl("patch", "trainingspec", name, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": spec}))


def running_pods(rig, ns: str, name: str) -> list[dict]:
    return [p for p in items(rig, ns, "pods", f"kiln.dev/trainingspec={name}")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


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
