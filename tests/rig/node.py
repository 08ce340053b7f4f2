"""The rig's real node: a kubelet that runs containers, beside the kwok GPU nodes.

containerd (with Debian's runc) runs the pods on the rig's bridge (CNI bridge + host-local),
kube-proxy (iptables) serves ClusterIP Services, CoreDNS serves cluster.local from the
apiserver behind the `kube-dns` Service. All of it runs as host processes of the rig, with
its state under `<run dir>/node`. It starts only when asked (`cluster.up_node()`,
`python -m tests.rig up --node`, the pytest fixture `real_node`) and stops with the rig
(or `python -m tests.rig down --node`), removing the pods, mounts, iptables rules and
sysctl changes it made. docs/rig.md, "The real node", explains every setting.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.rig import build, cluster, oci, pki

NAME = "kiln-node"
TAINT = {"key": "kiln.dev/real-node", "value": "true", "effect": "NoSchedule"}
LABELS = {"kiln.dev/real-node": "true"}
DNS_SERVICE_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
# Images the node makes itself; nothing is pulled (no registry is reachable).
SANDBOX_IMAGE = "localhost/kiln-rig/pause:1"
PROBE_IMAGE = "localhost/kiln-rig/probe:1"
K8S_NAMESPACE = "k8s.io"  # containerd's namespace for what the kubelet runs
_OFFSET = cluster._PORT_OFFSET
PORTS = {
    "kubelet": 10250 + _OFFSET,
    "kubelet-healthz": 10248 + _OFFSET,
    "kube-proxy-healthz": 10256 + _OFFSET,
    "kube-proxy-metrics": 10249 + _OFFSET,
    "coredns-health": 18053 + _OFFSET,
    "coredns-ready": 18054 + _OFFSET,
}
# The kubelet sets these kernel settings when it starts (container_manager_linux.go
# setupKernelTunables); the node records them before and puts them back on stop.
KUBELET_SYSCTLS = ["vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"]
# Routing between the bridge and its own address needs forwarding on (pod -> ClusterIP -> pod).
NODE_SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}
# Pods may talk to each other, the node and the rig's servers, never beyond this machine: the
# rig's own FORWARD rules reject what would be routed between the bridge and other interfaces.
_COMMENT = ["-m", "comment", "--comment", f"kiln-rig {cluster.BRIDGE}: pods stay on this machine", "-j", "REJECT"]
FORWARD_RULES = [
    ["FORWARD", "-i", cluster.BRIDGE, "!", "-o", cluster.BRIDGE, *_COMMENT],
    ["FORWARD", "!", "-i", cluster.BRIDGE, "-o", cluster.BRIDGE, *_COMMENT],
]
# Chains that stay after `kube-proxy --cleanup`: the kubelet's own (in iptables and ip6tables)
# and those the CNI portmap plugin makes.
LEFTOVER_CHAINS = [
    ("filter", "KUBE-FIREWALL"), ("filter", "KUBE-KUBELET-CANARY"), ("nat", "KUBE-KUBELET-CANARY"),
    ("mangle", "KUBE-KUBELET-CANARY"), ("mangle", "KUBE-IPTABLES-HINT"),
    ("nat", "CNI-HOSTPORT-DNAT"), ("nat", "CNI-HOSTPORT-SETMARK"), ("nat", "CNI-HOSTPORT-MASQ"),
]
# One real node per machine: kube-proxy's iptables chains are machine-wide.
MACHINE_LOCK = Path("/run/kiln-rig-node.lock")


def node_dir() -> Path:
    return cluster.run_dir() / "node"


def logs_dir() -> Path:
    return cluster.run_dir() / "logs"


def _bin(name: str) -> str:
    return str(build.node_bin_dir() / name)


def containerd_socket() -> Path:
    return node_dir() / "containerd" / "containerd.sock"


class NodeUnavailable(RuntimeError):
    """The real node cannot run here or now; the message says why and what to do."""


@dataclass
class Node:
    """The running real node, as tests see it.

    Pods land on it only if they tolerate `taint` (its label `labels` selects it); they run
    images already in its containerd (`import_image`) with `imagePullPolicy: Never` or
    `IfNotPresent`. From a pod, the apiserver is the `kubernetes` Service (in-cluster config)
    or `api_server`, the rig's S3 is `s3_endpoint` (same keys and bucket as the rig's).
    """

    name: str
    ip: str
    api_server: str
    s3_endpoint: str
    taint: dict = field(default_factory=lambda: dict(TAINT))
    labels: dict = field(default_factory=lambda: dict(LABELS))
    dns_service_ip: str = DNS_SERVICE_IP
    sandbox_image: str = SANDBOX_IMAGE
    probe_image: str = PROBE_IMAGE
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def toleration(self) -> dict:
        """The toleration a pod spec needs to run here."""
        return {"key": self.taint["key"], "operator": "Equal", "value": self.taint["value"],
                "effect": self.taint["effect"]}

    @property
    def node_selector(self) -> dict:
        """Its pool's label, not its hostname: kiln's admin policy refuses picking a node by name by default
        (KILN_POLICY_ALLOW_NODE_NAMES), and the chart's operator runs with that default."""
        return dict(LABELS)

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        """containerd's `ctr`, in the kubelet's namespace (k8s.io)."""
        return _run([_bin("ctr"), "--address", str(containerd_socket()), "--namespace", K8S_NAMESPACE, *args],
                    check=check, timeout=timeout)

    def crictl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """`crictl` against the node's containerd: pods and containers as the kubelet sees them."""
        return _crictl(*args, check=check, timeout=timeout)

    def import_image(self, tar_path: str | Path) -> list[str]:
        """Load an image archive (docker-archive, e.g. from `buildah push … docker-archive:`, or an
        OCI archive) into the node's containerd, unpacked for the kubelet; return the image names.

        A name without a registry is stored as docker.io/library/<name>, which is also how the
        kubelet reads `image: <name>` in a pod spec.
        """
        return import_image(tar_path)

    def images(self) -> list[str]:
        """Names of the images in the node's containerd."""
        return self.ctr("images", "list", "--quiet").stdout.split()

    def remove_untagged_images(self) -> list[str]:
        """Remove images no name points at any more; return their ids.

        The CRI keeps a `sha256:<id>` record of every image it has seen, so each rebuild of the
        trainer image left ~7 GB behind that no pod can ask for (containerd collects the layers
        once no record or container holds them). Containers still running keep their snapshots.
        """
        listed = json.loads(self.crictl("images", "-o", "json").stdout or "{}").get("images", [])
        untagged = [image["id"] for image in listed if not image.get("repoTags")]
        for image_id in untagged:
            self.crictl("rmi", image_id, check=False)
        return untagged


def _run(cmd: list[str], check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def crictl_config() -> Path:
    """crictl's config for this node (`crictl --config <this> ps`), written on first use."""
    path = node_dir() / "crictl.yaml"
    if not path.exists():
        sock = f"unix://{containerd_socket()}"
        node_dir().mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"runtime-endpoint": sock, "image-endpoint": sock, "timeout": 60}))
    return path


def _crictl(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run([_bin("crictl"), "--config", str(crictl_config()), *args], check=check, timeout=timeout)


def import_image(tar_path: str | Path) -> list[str]:
    """See `Node.import_image`."""
    names = oci.archive_image_names(Path(tar_path))
    _run([_bin("ctr"), "--address", str(containerd_socket()), "--namespace", K8S_NAMESPACE,
          # The kubelet runs the unpacked snapshots; the layer blobs would be a second ~7 GB copy of the trainer
          # (ctr discards them only when it imports itself, --local, not through the transfer service).
          "images", "import", "--local", "--snapshotter", "overlayfs", "--discard-unpacked-layers", str(tar_path)],
         timeout=1800)
    present = set(_run([_bin("ctr"), "--address", str(containerd_socket()), "--namespace", K8S_NAMESPACE,
                        "images", "list", "--quiet"]).stdout.split())
    missing = [n for n in names if n not in present]
    if missing:
        raise RuntimeError(f"ctr images import {tar_path}: {missing} not in containerd afterwards")
    return names


# --- configuration files -------------------------------------------------------------------

def _containerd_config(nd: Path) -> str:
    # restrict_oom_score_adj: runc may not lower oom_score_adj without CAP_SYS_RESOURCE, which
    # root lacks here; this keeps every container's score at or above containerd's own.
    # netns_mounts_under_state_dir: pod network namespaces live under the node's state folder.
    # The NRI and opt plugins would make sockets and folders under /var/run/nri and /opt.
    return f"""version = 4
root = "{nd / 'containerd' / 'root'}"
state = "{nd / 'containerd' / 'state'}"
imports = []

[plugins.'io.containerd.server.v1.grpc']
  address = "{containerd_socket()}"
[plugins.'io.containerd.server.v1.ttrpc']
  address = "{containerd_socket()}.ttrpc"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.internal.v1.opt']
  path = "{nd / 'containerd' / 'opt'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{SANDBOX_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{build.node_bin_dir()}"]
    conf_dir = "{nd / 'cni' / 'net.d'}"
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{shutil.which('runc') or '/usr/sbin/runc'}"
        SystemdCgroup = false

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
"""


def _cni_config(nd: Path) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "kiln-rig",
        "plugins": [
            {
                "type": "bridge", "bridge": cluster.BRIDGE, "isDefaultGateway": True, "hairpinMode": True,
                "ipMasq": False,  # nothing leaves this machine, so nothing is translated
                "ipam": {"type": "host-local", "dataDir": str(nd / "cni" / "ipam"),
                         "ranges": [[{"subnet": cluster.POD_SUBNET, "gateway": cluster.BRIDGE_IP}]]},
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "backend": "iptables"},
        ],
    }


def _kubelet_config(nd: Path, pkd: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine has cgroup v1 (hybrid) and no systemd managing cgroups.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{containerd_socket()}",
        "address": cluster.BRIDGE_IP,
        "port": PORTS["kubelet"],
        "readOnlyPort": 0,
        "healthzBindAddress": cluster.HOST,
        "healthzPort": PORTS["kubelet-healthz"],
        "tlsCertFile": str(pkd / "kubelet.crt"),
        "tlsPrivateKeyFile": str(pkd / "kubelet.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pkd / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [DNS_SERVICE_IP],
        "podLogsDir": str(nd / "pod-logs"),
        "registerWithTaints": [TAINT],
        "failSwapOn": False,
        # The machine's disk is shared with builds (Go caches, image builds) and reserves much of
        # its size, so the default relative thresholds (evict under 10-15% free, delete unused
        # images above 85% used) would evict test pods and delete imported images because of
        # other work. Evict only when the disk is really full; never collect images.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1Gi", "nodefs.inodesFree": "5%",
                         "imagefs.available": "1Gi", "imagefs.inodesFree": "5%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
    }


def _kube_proxy_config(kubeconfig: Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NAME,
        "clusterCIDR": cluster.POD_SUBNET,
        "healthzBindAddress": f"{cluster.HOST}:{PORTS['kube-proxy-healthz']}",
        "metricsBindAddress": f"{cluster.HOST}:{PORTS['kube-proxy-metrics']}",
        # NodePorts on the node IP only; no route_localnet for NodePorts on 127.0.0.1.
        "nodePortAddresses": ["primary"],
        "iptables": {"localhostNodePorts": False},
        # 0: leave the machine's conntrack table size and timeouts as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def _corefile(kubeconfig: Path) -> str:
    # No forward plugin: nothing outside cluster.local is resolvable, as nothing is reachable.
    return f""".:53 {{
    bind {cluster.BRIDGE_IP}
    errors
    log
    health {cluster.HOST}:{PORTS['coredns-health']}
    ready {cluster.HOST}:{PORTS['coredns-ready']}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} kiln-rig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
"""


def _cluster_objects() -> list[dict]:
    """RBAC for CoreDNS and the `kube-dns` Service, whose endpoint is CoreDNS on the bridge."""
    dns_ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}]},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
         "spec": {"clusterIP": DNS_SERVICE_IP, "ports": dns_ports}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-rig", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "kiln.dev-rig"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [cluster.BRIDGE_IP], "conditions": {"ready": True}}],
         "ports": dns_ports},
    ]


# --- host settings -------------------------------------------------------------------------

def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key


def _read_sysctls(keys: list[str]) -> dict[str, str]:
    return {k: _sysctl_path(k).read_text().strip() for k in keys if _sysctl_path(k).exists()}


def _write_sysctls(values: dict[str, str]) -> None:
    for key, value in values.items():
        try:
            if _sysctl_path(key).read_text().strip() != value:
                _sysctl_path(key).write_text(value)
        except OSError as exc:
            cluster.log(f"could not set {key}={value}: {exc}")


def _iptables(*args: str, check: bool = True, cmd: str = "iptables") -> subprocess.CompletedProcess:
    return _run([cmd, "-w", "5", *args], check=check)


def _drop_chain(cmd: str, table: str, chain: str) -> None:
    """Remove a chain and every rule that jumps to it."""
    if _iptables("-t", table, "-S", chain, check=False, cmd=cmd).returncode != 0:
        return
    for rule in _iptables("-t", table, "-S", cmd=cmd).stdout.splitlines():
        if rule.startswith("-A ") and rule.endswith(f"-j {chain}"):
            _iptables("-t", table, "-D", *rule.split()[1:], check=False, cmd=cmd)
    _iptables("-t", table, "-F", chain, check=False, cmd=cmd)
    _iptables("-t", table, "-X", chain, check=False, cmd=cmd)


# --- processes -----------------------------------------------------------------------------

def _state_path() -> Path:
    return node_dir() / "state.json"


def _read_state() -> dict | None:
    return cluster.read_state(_state_path())


def _save(state: dict) -> None:
    node_dir().mkdir(parents=True, exist_ok=True)
    _state_path().write_text(json.dumps(state, indent=2))


def _node_certs(pkd: Path) -> None:
    pki.make_cert(pkd, "kubelet-client", "ca", f"/CN=system:node:{NAME}/O=system:nodes", client=True)
    pki.make_cert(pkd, "kubelet", "ca", f"/CN={NAME}", dns=(NAME,), ips=(cluster.BRIDGE_IP,))
    pki.make_cert(pkd, "kube-proxy", "ca", "/CN=system:kube-proxy", client=True)
    pki.make_cert(pkd, "coredns", "ca", "/CN=system:coredns", client=True)


def _sandbox_and_probe_images(nd: Path) -> list[Path]:
    out = []
    for image, binary in ((SANDBOX_IMAGE, "pause"), (PROBE_IMAGE, "probe")):
        tar = nd / "images" / f"{binary}.tar"
        oci.image_archive(image, {f"/{binary}": build.node_bin_dir() / binary}, [f"/{binary}"], tar)
        out.append(tar)
    return out


def _healthz(port: int) -> bool:
    return cluster._http_ok(f"http://{cluster.HOST}:{port}/healthz")


def running(rig: cluster.Rig) -> Node | None:
    """The real node of this rig, if all its processes live and it is Ready."""
    state = _read_state()
    if not state or "ready" not in state:
        return None
    if any(not cluster._alive(p["pid"], p["exe"]) for p in state["procs"].values()):
        return None
    if not (_node_exists(rig) and rig.node_ready(NAME)):
        return None
    return _node_object(rig)


def _node_exists(rig: cluster.Rig) -> bool:
    return rig.kubectl("get", "node", NAME, check=False).returncode == 0


def _node_object(rig: cluster.Rig) -> Node:
    logs = {name: logs_dir() / f"{name}.log" for name in ("containerd", "kubelet", "kube-proxy", "coredns")}
    return Node(name=NAME, ip=cluster.BRIDGE_IP, api_server=f"https://{cluster.BRIDGE_IP}:{cluster.PORTS['apiserver']}",
                s3_endpoint=f"http://{cluster.BRIDGE_IP}:{cluster.PORTS['s3']}", logs=logs)


def up(rig: cluster.Rig) -> Node:
    """Start the real node for `rig` (or reuse the running one); build what it needs first."""
    if not rig.bridge_ip:
        raise NodeUnavailable(
            "the running rig has no bridge (it was started without root, or by code from before the real "
            "node): stop it with `python -m tests.rig down` and start it again as root")
    build.ensure_sbin_on_path()  # the kubelet, kube-proxy and the cleanup below run iptables and conntrack
    with cluster._flock("node.lock"):
        node = running(rig)
        if node is not None:
            cluster.log("reusing the running real node")
            return node
        stop()  # whatever a failed or stale node left behind
        build.build_node()
        start = time.monotonic()
        cluster.log(f"starting the real node {NAME} on {cluster.BRIDGE} ({cluster.BRIDGE_IP})")
        node = _start_node(rig)
        cluster.log(f"real node Ready in {time.monotonic() - start:.1f}s; logs in {logs_dir()}")
        return node


def _claim_machine() -> None:
    """One real node per machine: kube-proxy's chains (KUBE-SERVICES, ...) are machine-wide."""
    try:
        owner = json.loads(MACHINE_LOCK.read_text())
    except (OSError, ValueError):
        owner = None
    if owner and owner["run_dir"] != str(cluster.run_dir()) and cluster._alive(owner["pid"], owner["exe"]):
        raise NodeUnavailable(
            f"another rig's real node runs on this machine (run dir {owner['run_dir']}); one node per machine, "
            "since kube-proxy's iptables chains are machine-wide: stop that one first")


def _start_node(rig: cluster.Rig) -> Node:
    _claim_machine()
    nd, pkd = node_dir(), cluster.run_dir() / "pki"
    for stale in ("kubelet", "cni", "containerd/state", "pod-logs"):
        shutil.rmtree(nd / stale, ignore_errors=True)
    for d in ("containerd/root", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "images"):
        (nd / d).mkdir(parents=True, exist_ok=True)
    procs: dict = {}
    state = {"procs": procs, "started": time.time(),
             "sysctls": _read_sysctls(KUBELET_SYSCTLS + list(NODE_SYSCTLS))}
    _save(state)  # from here on, stop() knows what to put back
    try:
        _write_sysctls(NODE_SYSCTLS)
        state["forward_rules"] = True
        for rule in FORWARD_RULES:
            if _iptables("-C", *rule, check=False).returncode != 0:
                _iptables("-I", *rule)
        _node_certs(pkd)
        (nd / "containerd" / "config.toml").write_text(_containerd_config(nd))
        (nd / "cni" / "net.d" / "10-kiln-rig.conflist").write_text(json.dumps(_cni_config(nd), indent=2))
        server = rig.api_server
        kubelet_kc = cluster.cert_kubeconfig("kubelet-client", server)
        proxy_kc = cluster.cert_kubeconfig("kube-proxy", server)
        dns_kc = cluster.cert_kubeconfig("coredns", server)
        (nd / "kubelet-config.yaml").write_text(yaml.safe_dump(_kubelet_config(nd, pkd)))
        (nd / "kube-proxy-config.yaml").write_text(yaml.safe_dump(_kube_proxy_config(proxy_kc)))
        (nd / "Corefile").write_text(_corefile(dns_kc))

        env = {"PATH": f"{build.node_bin_dir()}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        cluster._start("containerd", [_bin("containerd"), "--config", str(nd / "containerd" / "config.toml")],
                       procs, env=env)
        MACHINE_LOCK.write_text(json.dumps({"run_dir": str(cluster.run_dir()), **procs["containerd"]}))
        _save(state)
        cluster._wait("containerd", lambda: _crictl("info", check=False).returncode == 0, 60, procs, "containerd")
        for tar in _sandbox_and_probe_images(nd):
            import_image(tar)

        rig.apply(_cluster_objects())
        cluster._start("coredns", [_bin("coredns"), "-conf", str(nd / "Corefile")], procs)
        cluster._start("kube-proxy", [_bin("kube-proxy"), f"--config={nd / 'kube-proxy-config.yaml'}"], procs)
        cluster._start("kubelet", [
            _bin("kubelet"), f"--config={nd / 'kubelet-config.yaml'}", f"--kubeconfig={kubelet_kc}",
            f"--root-dir={nd / 'kubelet'}", f"--hostname-override={NAME}", f"--node-ip={cluster.BRIDGE_IP}",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in LABELS.items()),
        ], procs, env=env)
        _save(state)
        cluster._wait("CoreDNS ready", lambda: cluster._http_ok(
            f"http://{cluster.HOST}:{PORTS['coredns-ready']}/ready"), 60, procs, "coredns")
        cluster._wait("kube-proxy", lambda: _healthz(PORTS["kube-proxy-healthz"]), 60, procs, "kube-proxy")
        cluster._wait("kubelet", lambda: _healthz(PORTS["kubelet-healthz"]), 120, procs, "kubelet")
        cluster._wait(f"node {NAME} Ready", lambda: _node_exists(rig) and rig.node_ready(NAME), 120, procs,
                      "kubelet")
    except BaseException:
        _save(state)
        stop()
        raise
    state["ready"] = time.time()
    _save(state)
    return _node_object(rig)


# --- stop ----------------------------------------------------------------------------------

def _mounts_under(root: Path) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(root) or point.startswith(str(root) + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)  # deepest first


def _kill_shims() -> None:
    """containerd's shims outlive containerd by design; end ours (by pid) if any are left."""
    sock = str(containerd_socket())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].decode(errors="replace").endswith("containerd-shim-runc-v2") and sock.encode() in args:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _remove_kubepods_cgroups() -> None:
    """The kubelet's (now empty) cgroups, deepest first, in every v1 hierarchy."""
    for top in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def stop() -> None:
    """Stop the real node and undo what it changed on this machine (idempotent)."""
    state = _read_state()
    if state is None:
        return
    procs = state.get("procs", {})
    kubelet_etc = {k: v for k, v in procs.items() if k != "containerd"}
    cluster._stop_procs(kubelet_etc)  # first, so nothing restarts the pods removed below
    if "containerd" in procs and cluster._alive(procs["containerd"]["pid"], procs["containerd"]["exe"]):
        # Through CRI, so each pod's network is torn down by its CNI plugins.
        _crictl("rmp", "--all", "--force", check=False, timeout=180)
    cluster._stop_procs({k: v for k, v in procs.items() if k == "containerd"})
    _kill_shims()
    for point in _mounts_under(node_dir()):
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True)
    if shutil.which("iptables"):
        kube_proxy = build.node_bin_dir() / "kube-proxy"
        if kube_proxy.exists():
            subprocess.run([str(kube_proxy), "--cleanup"], capture_output=True, timeout=60)
        for cmd in ("iptables", "ip6tables"):
            for table, chain in LEFTOVER_CHAINS:
                _drop_chain(cmd, table, chain)
        if state.get("forward_rules"):
            for rule in FORWARD_RULES:
                _iptables("-D", *rule, check=False)
    _write_sysctls(state.get("sysctls", {}))
    _remove_kubepods_cgroups()
    for stale in ("kubelet", "cni", "containerd/state", "pod-logs"):
        shutil.rmtree(node_dir() / stale, ignore_errors=True)
    try:
        if json.loads(MACHINE_LOCK.read_text())["run_dir"] == str(cluster.run_dir()):
            MACHINE_LOCK.unlink()
    except (OSError, ValueError, KeyError):
        pass
    _state_path().unlink(missing_ok=True)
    cluster.log("real node stopped")


def down(rig: cluster.Rig | None) -> None:
    """Stop the real node and remove its Node object (its pods go with it)."""
    with cluster._flock("node.lock"):
        stop()
    if rig is not None and rig.healthy():
        rig.kubectl("delete", "node", NAME, "--ignore-not-found", "--wait=false", check=False)
