"""Start, reuse, inspect and stop the rig on 127.0.0.1 and the rig's bridge.

All state lives in one run directory (`$KILN_CACHE_DIR/rig-run`): certificates,
etcd and S3 data, logs, kubeconfigs and `state.json` (pids and environment).
`up()` holds a file lock, so several pytest sessions on this machine share one
rig: the first starts it, the others find it healthy and reuse it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.rig import build, pki, versions

HOST = "127.0.0.1"
# A second rig on the same machine (another KILN_CACHE_DIR) needs other ports: set an offset.
_PORT_OFFSET = int(os.environ.get("KILN_RIG_PORT_OFFSET", "0"))
PORTS = {
    "etcd": 12379,
    "etcd-peer": 12380,
    "apiserver": 16443,
    "controller-manager": 20257,
    "scheduler": 20259,
    "kwok": 20247,
    "s3": 19000,
    "operator-metrics": 18080,
    "operator-probe": 18081,
    "operator-webhook": 19443,
    # Kueue (tests/rig/kueue.py), started on demand
    "kueue-webhook": 19444,
    "kueue-metrics": 18082,
    "kueue-probe": 18083,
}
PORTS = {name: port + _PORT_OFFSET for name, port in PORTS.items()}

# The rig's network, for the real node (tests/rig/node.py; docs/rig.md "The real node"): a
# bridge on this machine whose address is the node's IP and where the apiserver and S3 listen
# for pods (a pod's 127.0.0.1 is its own). Made by `up` when it runs as root; without it the
# rig runs on 127.0.0.1 alone and has no real node. One bridge and /24 per port offset.
BRIDGE = f"kiln{_PORT_OFFSET}"
BRIDGE_IP = f"10.88.{_PORT_OFFSET % 256}.1"
POD_SUBNET = f"10.88.{_PORT_OFFSET % 256}.0/24"
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service: the first address of SERVICE_CIDR
S3_ACCESS_KEY = "kiln-rig"
S3_SECRET_KEY = "kiln-rig-secret-key"
S3_BUCKET = "kiln"

# Fake GPU nodes managed by kwok; the real scheduler places pods on them.
GPU_NODES = ["kwok-gpu-0", "kwok-gpu-1"]
GPUS_PER_NODE = 8
GPU_PRODUCT = "NVIDIA-H200"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# kwok's own chaos stages act on these labels (see `kwok_stage_files`).
NODE_NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"
POD_SUCCEED_LABEL = "kiln.dev/rig-succeed"  # our stage in tests/rig/stages.yaml

# The training-operator's webhook: it validates PyTorchJobs at this URL (see docs/rig.md).
OPERATOR_NAMESPACE = "kubeflow"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"
WEBHOOK_SECRET = "training-operator-webhook-cert"
WEBHOOK_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # hard-coded in the operator
# That folder is one per machine, so every rig on the machine shares one webhook certificate.
WEBHOOK_PKI = WEBHOOK_CERT_DIR.parent / "kiln-rig-pki"


def run_dir() -> Path:
    return build.cache_dir() / "rig-run"


def log(msg: str) -> None:
    print(f"[rig {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Rig:
    """A running rig, as tests and the CLI see it."""

    kubeconfig: Path
    bin: Path
    s3_endpoint: str
    api_server: str = f"https://{HOST}:{PORTS['apiserver']}"
    bridge_ip: str | None = None  # the rig's bridge address, where pods reach the apiserver and S3
    s3_access_key: str = S3_ACCESS_KEY
    s3_secret_key: str = S3_SECRET_KEY
    s3_bucket: str = S3_BUCKET
    gpu_nodes: list[str] = field(default_factory=lambda: list(GPU_NODES))
    gpus_per_node: int = GPUS_PER_NODE
    gpu_product: str = GPU_PRODUCT

    @property
    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "KILN_S3_ENDPOINT": self.s3_endpoint,
            "KILN_S3_ACCESS_KEY": self.s3_access_key,
            "KILN_S3_SECRET_KEY": self.s3_secret_key,
            "KILN_S3_BUCKET": self.s3_bucket,
            "KILN_RIG_BIN": str(self.bin),
        }

    def exports(self) -> str:
        return "\n".join(f"export {k}={v}" for k, v in self.env.items())

    # --- Kubernetes ---------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, as_user: str | None = None,
        kubeconfig: Path | None = None, timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        """Run kubectl as the admin, or impersonating `as_user` (e.g. system:serviceaccount:ns:name)."""
        cmd = [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig)]
        if as_user:
            cmd.append(f"--as={as_user}")
        proc = subprocess.run(
            cmd + list(args), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd + list(args), proc.stdout, proc.stderr)
        return proc

    def apply(self, manifest: dict | list | str) -> None:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump_all(
            manifest if isinstance(manifest, list) else [manifest]
        )
        self.kubectl("apply", "-f", "-", input=text)

    def kubeconfig_for_service_account(self, namespace: str, name: str, duration: str = "24h") -> Path:
        """A kubeconfig that authenticates as a ServiceAccount with a token from the TokenRequest API."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        path = run_dir() / "sa-kubeconfigs" / f"{namespace}.{name}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(path, user=f"{namespace}:{name}", credentials={"token": token}, server=self.api_server)
        return path

    def minio_client(self, access_key: str | None = None, secret_key: str | None = None):
        from minio import Minio

        return Minio(
            self.s3_endpoint.removeprefix("http://"),
            access_key=access_key or self.s3_access_key,
            secret_key=secret_key or self.s3_secret_key,
            secure=False,
        )

    # --- fault injection on kwok nodes and pods -----------------------------------------------

    def set_node_ready(self, node: str, ready: bool) -> None:
        """Make a kwok node report Ready=False (kwok's node-not-ready stage) or Ready=True again."""
        label = f"{NODE_NOT_READY_LABEL}-" if ready else f"{NODE_NOT_READY_LABEL}=true"
        self.kubectl("label", "node", node, label, "--overwrite")

    def node_ready(self, node: str) -> bool:
        out = self.kubectl(
            "get", "node", node, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
        ).stdout
        return out.strip() == "True"

    def fail_pod(self, namespace: str, pod: str, exit_code: int = 1) -> None:
        """Make a Running kwok pod's containers terminate with `exit_code`; the pod goes Failed."""
        self.kubectl("annotate", "pod", pod, "-n", namespace, f"{POD_FAIL_EXIT_CODE}={exit_code}", "--overwrite")
        self.kubectl("label", "pod", pod, "-n", namespace, f"{POD_FAIL_LABEL}=true", "--overwrite")

    def succeed_pod(self, namespace: str, pod: str) -> None:
        """Make a Running kwok pod's containers exit 0; the pod goes Succeeded."""
        self.kubectl("label", "pod", pod, "-n", namespace, f"{POD_SUCCEED_LABEL}=true", "--overwrite")

    def wait_for(self, what: str, predicate, timeout: float = 60, interval: float = 0.5):
        """Poll `predicate()` until it returns something truthy; fail naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    def gpus_in_use(self) -> dict[str, int]:
        """`namespace/pod` → GPUs, for pods bound to a node and not finished."""
        pods = json.loads(self.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
        used = {}
        for pod in pods:
            if not pod["spec"].get("nodeName") or pod["status"].get("phase") in ("Succeeded", "Failed"):
                continue
            gpus = sum(int(c.get("resources", {}).get("requests", {}).get("nvidia.com/gpu", 0))
                       for c in pod["spec"]["containers"])
            if gpus:
                used[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"] = gpus
        return used

    def exclusive_gpus(self):
        """Context manager: use every kwok GPU without other pytest sessions on this machine."""
        return exclusive_gpus()

    # --- health -------------------------------------------------------------------------------

    def healthy(self) -> bool:
        return _https_ok(f"{self.api_server}/readyz") and _s3_up(self.s3_endpoint)


def _ssl_context() -> ssl.SSLContext:
    pkd = run_dir() / "pki"
    ctx = ssl.create_default_context(cafile=str(pkd / "ca.crt"))
    ctx.load_cert_chain(str(pkd / "admin.crt"), str(pkd / "admin.key"))
    return ctx


def _https_ok(url: str, verify: bool = True) -> bool:
    try:
        ctx = _ssl_context() if verify else ssl._create_unverified_context()
        with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _s3_up(endpoint: str) -> bool:
    """Any HTTP answer means the S3 server listens (anonymous requests are refused with 403)."""
    try:
        urllib.request.urlopen(endpoint + "/", timeout=3)
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, urllib.error.URLError):
        return False


def write_kubeconfig(path: Path, user: str, credentials: dict, server: str) -> None:
    ca = (run_dir() / "pki" / "ca.crt").read_bytes()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kiln-rig", "cluster": {
            "server": server,
            "certificate-authority-data": base64.b64encode(ca).decode(),
        }}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "kiln-rig", "context": {"cluster": "kiln-rig", "user": user}}],
        "current-context": "kiln-rig",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config))
    tmp.chmod(0o600)
    tmp.replace(path)


def cert_kubeconfig(name: str, server: str) -> Path:
    """A kubeconfig for the client certificate `pki/<name>.crt` (made by `pki.make_cert`)."""
    pkd = run_dir() / "pki"
    path = run_dir() / f"{name}.kubeconfig"
    write_kubeconfig(path, user=name, credentials={
        "client-certificate-data": base64.b64encode((pkd / f"{name}.crt").read_bytes()).decode(),
        "client-key-data": base64.b64encode((pkd / f"{name}.key").read_bytes()).decode(),
    }, server=server)
    return path


def _make_pki(api_host: str) -> None:
    pkd = run_dir() / "pki"
    pkd.mkdir(parents=True, exist_ok=True)
    pki.make_ca(pkd, "ca", "kiln-rig-ca")
    pki.make_cert(
        pkd, "apiserver", "ca", "/CN=kube-apiserver",
        dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"),
        ips=tuple(dict.fromkeys((HOST, api_host, KUBERNETES_SERVICE_IP))),
    )
    pki.make_cert(pkd, "admin", "ca", "/CN=kiln-admin/O=system:masters", client=True)
    # The apiserver's identity towards kubelets (logs, exec, port-forward).
    pki.make_cert(pkd, "apiserver-kubelet-client", "ca", "/CN=kube-apiserver-kubelet-client/O=system:masters",
                  client=True)
    pki.make_cert(pkd, "scheduler", "ca", "/CN=system:kube-scheduler", client=True)
    pki.make_cert(pkd, "controller-manager", "ca", "/CN=system:kube-controller-manager", client=True)
    pki.make_service_account_keys(pkd)
    # The operator's cert rotator verifies its CA against the CA name and the serving cert
    # against <service>.<namespace>.svc; 127.0.0.1 is added so the apiserver can call it by URL.
    WEBHOOK_PKI.mkdir(parents=True, exist_ok=True)
    with open(WEBHOOK_PKI / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pki.make_ca(WEBHOOK_PKI, "webhook-ca", "training-operator-ca")
        pki.make_cert(
            WEBHOOK_PKI, "webhook", "webhook-ca", "/CN=training-operator.kubeflow.svc",
            dns=("training-operator.kubeflow.svc",), ips=(HOST,),
        )


# --- processes -------------------------------------------------------------------------------

def _state_path() -> Path:
    return run_dir() / "state.json"


def read_state(path: Path) -> dict | None:
    """A rig component's state file (what it started: pids, ports); None when it is absent or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_state() -> dict | None:
    return read_state(_state_path())


_CHILDREN: dict[int, subprocess.Popen] = {}  # processes started by this Python process


def _alive(pid: int, exe: str) -> bool:
    if pid in _CHILDREN:  # right after fork, /proc/<pid>/cmdline is still Python's
        return _CHILDREN[pid].poll() is None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return cmdline == exe


def _start(name: str, args: list[str], procs: dict, env: dict | None = None) -> None:
    """Start `args` (a binary in the rig's bin folder, or an absolute path) in its own session."""
    logs = run_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    exe = str(build.bin_dir() / args[0])  # an absolute args[0] stays as it is
    with open(logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            [exe, *args[1:]], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=run_dir(), start_new_session=True, env={**os.environ, **(env or {})},
        )
    _CHILDREN[proc.pid] = proc
    procs[name] = {"pid": proc.pid, "exe": exe}


def _port_busy(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _wait(what: str, check, timeout: float, procs: dict, name: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = procs[name]
        # Ours must be alive: a healthy answer from a stray process on the port does not count.
        if not _alive(info["pid"], info["exe"]):
            tail = (run_dir() / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited while waiting for {what}; log tail:\n{tail}")
        if check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not healthy after {timeout:.0f}s; see {run_dir() / 'logs' / (name + '.log')}")
        time.sleep(0.2)


def kwok_stage_files() -> list[Path]:
    """kwok's own stages, read from its module in the Go module cache, plus ours."""
    root = build.module_dir("sigs.k8s.io/kwok", versions.KWOK) / "kustomize" / "stage"
    return [
        root / "node" / "fast" / "node-initialize.yaml",
        root / "node" / "heartbeat-with-lease" / "node-heartbeat-with-lease.yaml",
        root / "node" / "chaos" / "node-not-ready.yaml",
        root / "pod" / "fast" / "pod-ready.yaml",
        root / "pod" / "fast" / "pod-complete.yaml",
        root / "pod" / "fast" / "pod-delete.yaml",
        root / "pod" / "chaos" / "pod-container-running-failed.yaml",
        Path(__file__).with_name("stages.yaml"),
    ]


def operator_crds() -> list[Path]:
    """The training-operator's CRDs, from its module's manifests/base/crds/ in the module cache."""
    crds = build.module_dir("github.com/kubeflow/training-operator", versions.TRAINING_OPERATOR)
    return sorted((crds / "manifests" / "base" / "crds").glob("kubeflow.org_*.yaml"))


def _gpu_node(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                GPU_PRODUCT_LABEL: GPU_PRODUCT,
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
            },
        },
        "status": {
            # ephemeral-storage: every trainer pod requests some (its data cache, KILN_DEFAULT_EPHEMERAL_STORAGE)
            "capacity": {"cpu": "96", "memory": "2Ti", "ephemeral-storage": "28Ti", "pods": "110",
                         "nvidia.com/gpu": str(GPUS_PER_NODE)},
            "allocatable": {"cpu": "96", "memory": "2Ti", "ephemeral-storage": "28Ti", "pods": "110",
                            "nvidia.com/gpu": str(GPUS_PER_NODE)},
        },
    }


def _webhook_objects() -> list[dict]:
    pkd = WEBHOOK_PKI

    def b64(name: str) -> str:
        return base64.b64encode((pkd / name).read_bytes()).decode()

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": WEBHOOK_SECRET, "namespace": OPERATOR_NAMESPACE},
            "data": {"ca.crt": b64("webhook-ca.crt"), "ca.key": b64("webhook-ca.key"),
                     "tls.crt": b64("webhook.crt"), "tls.key": b64("webhook.key")},
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK_CONFIGURATION},
            "webhooks": [{
                "name": "validator.pytorchjob.training-operator.kubeflow.org",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {
                    "url": f"https://{HOST}:{PORTS['operator-webhook']}/validate-kubeflow-org-v1-pytorchjob",
                    "caBundle": b64("webhook-ca.crt"),
                },
                "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"],
                           "operations": ["CREATE", "UPDATE"], "resources": ["pytorchjobs"]}],
            }],
        },
    ]


# --- the command line of each component ----------------------------------------------------

def _versitygw_cmd(rd: Path, bridge_ip: str | None) -> list[str]:
    # Host clients use 127.0.0.1; pods on the real node use the bridge address.
    listen = [arg for ip in (HOST, bridge_ip) if ip for arg in ("--port", f"{ip}:{PORTS['s3']}")]
    return ["versitygw", "--access", S3_ACCESS_KEY, "--secret", S3_SECRET_KEY, *listen, "posix", str(rd / "s3-data")]


def _etcd_cmd(rd: Path) -> list[str]:
    peer = f"http://{HOST}:{PORTS['etcd-peer']}"
    return [
        "etcd", "--name", "rig", "--data-dir", str(rd / "etcd-data"),
        "--listen-client-urls", f"http://{HOST}:{PORTS['etcd']}",
        "--advertise-client-urls", f"http://{HOST}:{PORTS['etcd']}",
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"rig={peer}",
        "--unsafe-no-fsync", "--log-level", "warn",  # a throwaway test store
    ]


def _apiserver_cmd(pkd: Path, api_host: str) -> list[str]:
    cmd = [
        "kube-apiserver",
        f"--etcd-servers=http://{HOST}:{PORTS['etcd']}",
        # The bridge address when there is one: an apiserver listens on one address, and pods
        # reach it there (through the `kubernetes` Service, whose endpoint this address is).
        f"--bind-address={api_host}", f"--advertise-address={api_host}", f"--secure-port={PORTS['apiserver']}",
        f"--tls-cert-file={pkd / 'apiserver.crt'}", f"--tls-private-key-file={pkd / 'apiserver.key'}",
        f"--client-ca-file={pkd / 'ca.crt'}",
        "--authorization-mode=Node,RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pkd / 'sa.pub'}",
        f"--service-account-signing-key-file={pkd / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Reach kubelets (logs, exec) at their node IP, verifying their rig-signed certificates.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pkd / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pkd / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pkd / 'ca.crt'}",
        "--allow-privileged=true",
        "--profiling=false",
        "--shutdown-delay-duration=0s",
    ]
    if api_host == HOST:
        cmd.append("--endpoint-reconciler-type=none")  # 127.0.0.1 may not be a Service endpoint
    return cmd


def _controller_manager_cmd(pkd: Path, kubeconfig: Path) -> list[str]:
    return [
        "kube-controller-manager",
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}", f"--secure-port={PORTS['controller-manager']}",
        f"--service-account-private-key-file={pkd / 'sa.key'}", f"--root-ca-file={pkd / 'ca.crt'}",
        "--use-service-account-credentials=true", "--leader-elect=false",
        # Notice NotReady kwok nodes quickly, so node-failure tests need not wait 40s.
        "--node-monitor-grace-period=20s",
    ]


def _scheduler_cmd(kubeconfig: Path) -> list[str]:
    return [
        "kube-scheduler",
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}", f"--secure-port={PORTS['scheduler']}", "--leader-elect=false",
    ]


def _kwok_cmd(kubeconfig: Path, stages: Path) -> list[str]:
    return [
        "kwok", f"--kubeconfig={kubeconfig}", f"--config={stages}",
        "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        "--node-lease-duration-seconds=40", f"--server-address={HOST}:{PORTS['kwok']}",
    ]


def _operator_cmd(kubeconfig: Path) -> list[str]:
    return [
        "training-operator", f"--kubeconfig={kubeconfig}", "--enable-scheme=pytorchjob",
        f"--metrics-bind-address={HOST}:{PORTS['operator-metrics']}",
        f"--health-probe-bind-address={HOST}:{PORTS['operator-probe']}",
        f"--webhook-server-port={PORTS['operator-webhook']}",
        "--zap-log-level=info",
    ]


def _install_webhook_certs() -> None:
    WEBHOOK_CERT_DIR.mkdir(parents=True, exist_ok=True)
    for src, dst in (("webhook.crt", "tls.crt"), ("webhook.key", "tls.key")):
        tmp = WEBHOOK_CERT_DIR / f".{dst}.{os.getpid()}"
        shutil.copyfile(WEBHOOK_PKI / src, tmp)
        tmp.replace(WEBHOOK_CERT_DIR / dst)  # atomically: a running operator may be reading


def _https_health(port: str) -> Callable[[], bool]:
    return lambda: _https_ok(f"https://{HOST}:{PORTS[port]}/healthz", verify=False)


def _make_bridge() -> str | None:
    """The rig's bridge with its address (made or reused); None where this process may not
    make one (not root): the rig then runs without a real node."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        log("not root (or no `ip`): no bridge, so the rig runs on 127.0.0.1 only and has no real node")
        return None
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "replace", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    return BRIDGE_IP


def _remove_bridge() -> None:
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        _ip("link", "del", BRIDGE)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


def _start_all() -> Rig:
    rd, pkd = run_dir(), run_dir() / "pki"
    busy = {name: port for name, port in PORTS.items() if _port_busy(port)}
    if busy:
        raise RuntimeError(
            f"ports in use on {HOST}: {busy}; another rig (or something else) holds them. "
            "`python -m tests.rig down` stops a rig started from this run directory "
            f"({rd}); otherwise stop that process, or set KILN_RIG_PORT_OFFSET."
        )
    for stale in ("etcd-data", "s3-data", "logs", "sa-kubeconfigs"):
        shutil.rmtree(rd / stale, ignore_errors=True)
    bridge_ip = _make_bridge()
    api_host = bridge_ip or HOST
    if bridge_ip and _port_busy(PORTS["apiserver"], bridge_ip):
        raise RuntimeError(f"port {PORTS['apiserver']} on {bridge_ip} is in use (a stale rig?)")
    _make_pki(api_host)
    api_server = f"https://{api_host}:{PORTS['apiserver']}"
    admin_kc = cert_kubeconfig("admin", api_server)
    rig = Rig(kubeconfig=admin_kc, bin=build.bin_dir(), s3_endpoint=f"http://{HOST}:{PORTS['s3']}",
              api_server=api_server, bridge_ip=bridge_ip)
    procs: dict = {}
    state = {"procs": procs, "env": rig.env, "started": time.time(), "api_server": api_server,
             "bridge": {"name": BRIDGE, "ip": bridge_ip} if bridge_ip else None}

    def save() -> None:
        _state_path().write_text(json.dumps(state, indent=2))

    try:
        (rd / "s3-data").mkdir(parents=True)
        _start("versitygw", _versitygw_cmd(rd, bridge_ip), procs)
        _start("etcd", _etcd_cmd(rd), procs)
        save()
        _wait("S3 server", lambda: _s3_up(rig.s3_endpoint), 30, procs, "versitygw")
        client = rig.minio_client()
        if not client.bucket_exists(S3_BUCKET):
            client.make_bucket(S3_BUCKET)
        _wait("etcd", lambda: _http_ok(f"http://{HOST}:{PORTS['etcd']}/health"), 30, procs, "etcd")

        _start("kube-apiserver", _apiserver_cmd(pkd, api_host), procs)
        save()
        _wait("kube-apiserver", lambda: _https_ok(f"{api_server}/readyz"), 120, procs, "kube-apiserver")

        _start("kube-controller-manager",
               _controller_manager_cmd(pkd, cert_kubeconfig("controller-manager", api_server)), procs)
        _start("kube-scheduler", _scheduler_cmd(cert_kubeconfig("scheduler", api_server)), procs)
        stages = rd / "kwok-stages.yaml"
        stages.write_text("\n---\n".join(p.read_text() for p in kwok_stage_files()))
        _start("kwok", _kwok_cmd(admin_kc, stages), procs)
        save()

        rig.kubectl("apply", "--server-side", *[arg for p in operator_crds() for arg in ("-f", str(p))])
        rig.apply(_webhook_objects())
        rig.apply([_gpu_node(n) for n in GPU_NODES])
        _install_webhook_certs()
        rig.kubectl("wait", "--for=condition=Established", "crd/pytorchjobs.kubeflow.org", "--timeout=60s")
        _start("training-operator", _operator_cmd(admin_kc), procs, env={"MY_POD_NAMESPACE": OPERATOR_NAMESPACE})
        save()

        _wait("kube-scheduler", _https_health("scheduler"), 60, procs, "kube-scheduler")
        _wait("kube-controller-manager", _https_health("controller-manager"), 60, procs, "kube-controller-manager")
        _wait("kwok GPU nodes Ready", lambda: all(rig.node_ready(n) for n in GPU_NODES), 60, procs, "kwok")
        _wait("training-operator", lambda: _http_ok(f"http://{HOST}:{PORTS['operator-probe']}/readyz"), 90,
              procs, "training-operator")
        _wait("default ServiceAccount", lambda: rig.kubectl(
            "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            60, procs, "kube-controller-manager")
    except BaseException:
        save()
        _stop(state)
        raise
    state["ready"] = time.time()
    save()
    return rig


def _stop(state: dict) -> None:
    from tests.rig import node

    node.stop()  # the real node, if one runs, before the apiserver it reports to
    from tests.rig import kueue

    kueue.stop()
    _stop_procs(state.get("procs", {}))
    if state.get("bridge"):
        _remove_bridge()


def _stop_procs(procs: dict) -> None:
    # One at a time, dependents first: the apiserver shuts down quickly while etcd still answers.
    for name, info in reversed(list(procs.items())):
        if not _alive(info["pid"], info["exe"]):
            continue
        os.killpg(info["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(info["pid"], info["exe"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(info["pid"], info["exe"]):
            log(f"{name} did not stop on SIGTERM within 10s; killing it")
            os.killpg(info["pid"], signal.SIGKILL)


@contextmanager
def _flock(name: str) -> Iterator[None]:
    """An exclusive lock file in the run directory, shared by every process on this machine."""
    run_dir().mkdir(parents=True, exist_ok=True)
    with open(run_dir() / name, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _rig_from_state(state: dict) -> Rig:
    env = state["env"]
    return Rig(kubeconfig=Path(env["KUBECONFIG"]), bin=Path(env["KILN_RIG_BIN"]), s3_endpoint=env["KILN_S3_ENDPOINT"],
               api_server=state.get("api_server", f"https://{HOST}:{PORTS['apiserver']}"),
               bridge_ip=(state.get("bridge") or {}).get("ip"))


def running() -> Rig | None:
    """The rig already running on this machine, if all its processes live and it answers."""
    state = _read_state()
    if not state or "ready" not in state:
        return None
    dead = [n for n, p in state["procs"].items() if not _alive(p["pid"], p["exe"])]
    if dead:
        log(f"the recorded rig is not running ({', '.join(dead)} stopped)")
        return None
    rig = _rig_from_state(state)
    if Path(rig.env["KILN_RIG_BIN"]) != build.bin_dir():
        return None  # built from other pins: start the current one instead
    if not rig.healthy():
        log("the recorded rig does not answer (apiserver /readyz or S3)")
        return None
    return rig


def _leases() -> Path:
    return run_dir() / "users"


def _add_lease(pid: int) -> None:
    _leases().mkdir(parents=True, exist_ok=True)
    (_leases() / str(pid)).touch()


def _live_leases() -> list[int]:
    live = []
    for f in _leases().glob("*") if _leases().is_dir() else []:
        try:
            os.kill(int(f.name), 0)
            live.append(int(f.name))
        except (ValueError, ProcessLookupError, PermissionError):
            f.unlink(missing_ok=True)
    return live


def up(lease_pid: int | None = None) -> tuple[Rig, bool]:
    """Reuse a healthy rig or start one; returns (rig, started_here).

    With `lease_pid`, that process is recorded as a user of the rig (under the same lock),
    so `release()` by another user will not stop the rig under it.
    """
    with _flock("lock"):
        rig = running()
        if rig is not None:
            log("reusing the running rig")
            if lease_pid:
                _add_lease(lease_pid)
            return rig, False
        state = _read_state()
        if state:
            _stop(state)
        build.build()
        start = time.monotonic()
        log("starting the rig")
        rig = _start_all()
        log(f"rig up in {time.monotonic() - start:.1f}s; logs in {run_dir() / 'logs'}")
        if lease_pid:
            _add_lease(lease_pid)
        return rig, True


def up_node(lease_pid: int | None = None):
    """The rig (reused or started, as `up`) with its real node (reused or started); returns
    (rig, node.Node). The node is built and started only here: see tests/rig/node.py."""
    from tests.rig import node

    rig, _ = up(lease_pid)
    return rig, node.up(rig)


def release(lease_pid: int, stop_if_unused: bool) -> None:
    """Drop a user's lease; stop the rig if asked and no other live process still uses it."""
    with _flock("lock"):
        (_leases() / str(lease_pid)).unlink(missing_ok=True)
        if stop_if_unused and not _live_leases():
            state = _read_state()
            if state:
                _stop(state)
                _state_path().unlink(missing_ok=True)
                log("rig stopped (last user gone)")


@contextmanager
def exclusive_gpus() -> Iterator[None]:
    """Hold the rig's GPU nodes alone: pytest sessions sharing one rig take turns on the 16 GPUs."""
    with _flock("gpus.lock"):
        yield


def down() -> None:
    with _flock("lock"):
        state = _read_state()
        if state:
            _stop(state)
            _state_path().unlink(missing_ok=True)
            log("rig stopped")
        else:
            log("no rig state found")


def print_status() -> int:
    state = _read_state()
    if not state:
        print("rig: not started")
        return 1
    for name, info in state["procs"].items():
        print(f"{name:26} pid {info['pid']:>7}  {'running' if _alive(info['pid'], info['exe']) else 'stopped'}")
    rig = running()
    print(f"rig: {'healthy' if rig else 'not healthy'} (run dir {run_dir()})")
    from tests.rig import node

    node_state = node._read_state()
    for name, info in (node_state or {}).get("procs", {}).items():
        print(f"{name:26} pid {info['pid']:>7}  {'running' if _alive(info['pid'], info['exe']) else 'stopped'}")
    if node_state:
        print(f"real node {node.NAME}: {'Ready' if rig and node.running(rig) else 'not Ready'}")
    return 0 if rig else 1
