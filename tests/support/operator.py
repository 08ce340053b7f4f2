"""The kiln operator on the rig for a test: run as a shipped least-privilege ServiceAccount (cluster-wide or
namespaced: the `scope` fixture runs a module under both), its namespace (`ns`) and process (`operator`), and what
it wrote, read back through kubectl (get, status, condition, events, wait_phase); the apiserver as a client
(`kube`, dry runs and the fields it refuses)."""

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
from kubernetes.client.exceptions import ApiException

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control.kube import Kube, api_client
from tests.rig.install import install_crd, render, scratch_namespace
from tests.support.ranks import SAFETY_TIMEOUT_S, free_port, wait_until


ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "manifests" / "rbac"
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


def submit(rig, ns: str, body: dict) -> None:
    rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))


def patch_spec(rig, ns: str, name: str, spec: dict) -> None:
    rig.kubectl("patch", "trainingspec", name, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": spec}))


def running_pods(rig, ns: str, name: str) -> list[dict]:
    return [p for p in items(rig, ns, "pods", f"kiln.dev/trainingspec={name}")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def kube(rig) -> Kube:
    install_crd(rig)
    return Kube(api_client(str(rig.kubeconfig)))


def create_dry_run(kube: Kube, namespace: str, body: dict) -> None:
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")


def refused_fields(err: ApiException) -> set[str]:
    causes = json.loads(err.body).get("details", {}).get("causes", [])
    return {c.get("field", "") for c in causes}


@pytest.fixture
def operator_kube(rig, namespace, scope):
    """A Kube client authenticated as an operator ServiceAccount (in `namespace`) with a shipped RBAC."""
    with shipped_rbac(rig, namespace, scope) as (sa, _lease):
        yield Kube(api_client(str(rig.kubeconfig_for_service_account(namespace, sa))))
