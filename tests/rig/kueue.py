"""Kueue on the rig: the real `sigs.k8s.io/kueue` manager as a host process, started on demand.

Like the training-operator, Kueue runs outside the cluster with its webhooks on: the rig signs a serving
certificate for 127.0.0.1 with its CA, Kueue reads it from `certDir` (internal cert management off), and
the webhook configurations call it by `url:` (Kueue's own manifests name a Service, which a host process
has not). Only the webhooks of what is enabled here are registered (Kueue's own kinds and PyTorchJob):
a registered path the manager does not serve would refuse every such object.

Kueue manages only jobs labelled `kueue.x-k8s.io/queue-name` (`manageJobsWithoutQueueName: false`), so
starting it changes nothing for the other rig tests. It is started by the tests that use it (fixture
`kueue` in tests/conftest.py, or `up()` here) and stopped with the rig.

Set up as an admin would: the ResourceFlavor `rig-h200` for the kwok GPU nodes (by their GPU product
label), the topology-aware flavor `rig-h200-tas` of the same nodes (Topology `rig-hosts`, one level: the
host) and the ClusterQueue `rig-gpus` whose quota is all of their GPUs. Tests make their own
ClusterQueues (with smaller quotas, either flavor) and LocalQueues: `cluster_queue()` and `local_queue()`.

For topology-aware placement, a pool of kwok GPU nodes apart from the rig's two: 2 blocks × 2 racks × 2 hosts
× 8 GPUs (`POOL_NODES`), labelled by block, rack and host, the Topology `rig-racks` over those three levels
and its flavor `rig-h200-racks`. The pool nodes carry the taint POOL_TAINT, which only the flavor's
tolerations (Kueue adds them to the pods it admits there) tolerate, and no GPU product label: no other rig
test's pod lands on them, and kiln's elastic loop does not count them for runs that name a gpuType.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import yaml

from tests.rig import build, cluster, pki, versions

NAMESPACE = "kueue-system"  # Kueue's own namespace (its config's `namespace`)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FLAVOR = "rig-h200"
# Topology-aware scheduling: the same nodes as a flavor with a Topology, one level (the host). Kueue then
# admits a workload only where its pods fit on real nodes' free capacity (pods outside Kueue counted too).
TOPOLOGY = "rig-hosts"
TAS_FLAVOR = "rig-h200-tas"
HOST_LABEL = "kubernetes.io/hostname"
CLUSTER_QUEUE = "rig-gpus"
# The topology pool: block → rack → host.
BLOCK_LABEL = "rig.kiln.dev/block"
RACK_LABEL = "rig.kiln.dev/rack"
POOL_LABEL = "rig.kiln.dev/pool"
POOL_TAINT = {"key": "rig.kiln.dev/pool", "value": "racks", "effect": "NoSchedule"}
POOL_TOPOLOGY = "rig-racks"
POOL_FLAVOR = "rig-h200-racks"
BLOCKS, RACKS_PER_BLOCK, HOSTS_PER_RACK = 2, 2, 2
POOL_NODES = {f"kwok-topo-b{b}-r{r}-h{h}": {BLOCK_LABEL: f"b{b}", RACK_LABEL: f"b{b}-r{r}"}
              for b in range(BLOCKS) for r in range(RACKS_PER_BLOCK) for h in range(HOSTS_PER_RACK)}
GPU = "nvidia.com/gpu"
# waitForPodsReady: an admitted workload whose pods are not all Ready within this time is evicted (its job
# suspended, every pod deleted) and requeued; while one waits, no other workload is admitted (blockAdmission).
PODS_READY_TIMEOUT_S = 30
REQUEUE_BACKOFF_BASE_S = 5
WEBHOOK_PREFIXES = ("/mutate-kueue-x-k8s-io-", "/validate-kueue-x-k8s-io-",
                    "/mutate-kubeflow-org-v1-pytorchjob", "/validate-kubeflow-org-v1-pytorchjob")
# CRDs whose Kueue manifests enable a conversion webhook (config/components/crd/kustomization.yaml).
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
# With internal cert management off, Kueue reads its metrics server's certificate from this folder
# (a path compiled into it, like the training-operator's webhook folder): one per machine.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


# VisibilityOnDemand serves an aggregated API (an APIService the rig does not register): off.
# TASReplaceNodeOnNodeTaints (beta, on in v0.17.0) judges a node's taints by the Workload's own pod templates,
# not counting the tolerations the ResourceFlavor adds at admission (kubernetes-sigs/kueue#11152): it took
# the topology pool's tainted nodes for failed and failed the pods of runs it had just placed there. Off.
FEATURE_GATES = "VisibilityOnDemand=false,TASReplaceNodeOnNodeTaints=false"


def kueue_dir() -> Path:
    return cluster.run_dir() / "kueue"


def _module() -> Path:
    return build.module_dir("sigs.k8s.io/kueue", versions.KUEUE)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _url(path: str) -> str:
    return f"https://{cluster.HOST}:{cluster.PORTS['kueue-webhook']}{path}"


def config() -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a host process on the rig."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"{cluster.HOST}:{cluster.PORTS['kueue-probe']}"},
        "metrics": {"bindAddress": f"{cluster.HOST}:{cluster.PORTS['kueue-metrics']}"},
        "webhook": {"port": cluster.PORTS["kueue-webhook"], "host": cluster.HOST, "certDir": str(kueue_dir() / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "waitForPodsReady": {
            "timeout": f"{PODS_READY_TIMEOUT_S}s",
            "blockAdmission": True,
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": REQUEUE_BACKOFF_BASE_S,
                                  "backoffMaxSeconds": 60},
        },
        "integrations": {"frameworks": ["kubeflow.org/pytorchjob"]},
    }


def crds() -> list[dict]:
    """Kueue's CRDs from its module, with the conversion webhook its kustomization adds, by URL."""
    out = []
    ca = _b64(cluster.run_dir() / "pki" / "ca.crt")
    for path in sorted((_module() / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"url": _url("/convert"), "caBundle": ca}, "conversionReviewVersions": ["v1"]}}
        out.append(crd)
    return out


def webhook_configurations() -> list[dict]:
    """Kueue's webhook configurations from its module, kept to what runs here, pointed at 127.0.0.1."""
    ca = _b64(cluster.run_dir() / "pki" / "ca.crt")
    out = []
    text = (_module() / "config" / "components" / "webhook" / "manifests.yaml").read_text()
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        hooks = []
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            if path.startswith(WEBHOOK_PREFIXES):
                hook["clientConfig"] = {"url": _url(path), "caBundle": ca}
                hooks.append(hook)
        name = {"MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
                "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration"}[doc["kind"]]
        out.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"], "metadata": {"name": name},
                    "webhooks": hooks})
    return out


def resource_flavor() -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
            "spec": {"nodeLabels": {cluster.GPU_PRODUCT_LABEL: cluster.GPU_PRODUCT}}}


def topology() -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": TOPOLOGY},
            "spec": {"levels": [{"nodeLabel": HOST_LABEL}]}}


def tas_flavor() -> dict:
    flavor = resource_flavor()
    flavor["metadata"]["name"] = TAS_FLAVOR
    flavor["spec"]["topologyName"] = TOPOLOGY
    return flavor


def pool_node(name: str) -> dict:
    """A kwok GPU node of the topology pool (the rig's GPU node, relabelled and tainted)."""
    node = cluster._gpu_node(name)
    node["metadata"]["labels"].pop(cluster.GPU_PRODUCT_LABEL)
    node["metadata"]["labels"] |= {POOL_LABEL: "racks", **POOL_NODES[name]}
    node["spec"] = {"taints": [POOL_TAINT]}
    return node


def pool_topology() -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": POOL_TOPOLOGY},
            "spec": {"levels": [{"nodeLabel": BLOCK_LABEL}, {"nodeLabel": RACK_LABEL}, {"nodeLabel": HOST_LABEL}]}}


def pool_flavor() -> dict:
    toleration = {"key": POOL_TAINT["key"], "operator": "Equal", "value": POOL_TAINT["value"],
                  "effect": POOL_TAINT["effect"]}
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": POOL_FLAVOR},
            "spec": {"nodeLabels": {POOL_LABEL: "racks"}, "topologyName": POOL_TOPOLOGY,
                     "tolerations": [toleration]}}


COVERED = ("cpu", "memory", "ephemeral-storage", GPU)


def cluster_queue(name: str, gpus: int, namespaces: list[str] | None = None, preemption: dict | None = None,
                  flavor: str = FLAVOR, covered: tuple[str, ...] = COVERED) -> dict:
    """A ClusterQueue with `gpus` nvidia.com/gpu of the rig's flavor (CPU, memory and local disk: what the
    nodes have; Kueue admits nothing that requests a resource its ClusterQueue does not cover, and kiln's
    pods request all four).

    namespaces: the namespaces whose LocalQueues may use it (None: any). covered: the resources it covers (a
    subset of COVERED: Kueue's own examples leave out ephemeral-storage)."""
    nodes = len(POOL_NODES) if flavor == POOL_FLAVOR else len(cluster.GPU_NODES)
    spec: dict = {
        "namespaceSelector": ({"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                                     "values": namespaces}]} if namespaces else {}),
        "resourceGroups": [{
            "coveredResources": list(covered),
            "flavors": [{"name": flavor, "resources": [q for q in (
                {"name": "cpu", "nominalQuota": str(96 * nodes)},
                {"name": "memory", "nominalQuota": f"{2 * nodes}Ti"},
                {"name": "ephemeral-storage", "nominalQuota": f"{28 * nodes}Ti"},
                {"name": GPU, "nominalQuota": str(gpus)},
            ) if q["name"] in covered]}],
        }],
    }
    if preemption:
        spec["preemption"] = preemption
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


def local_queue(namespace: str, name: str, cluster_queue_name: str = CLUSTER_QUEUE) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": cluster_queue_name}}


# --- process --------------------------------------------------------------------------------------

def _state_path() -> Path:
    return kueue_dir() / "state.json"


def _read_state() -> dict | None:
    return cluster.read_state(_state_path())


def _rig_started() -> float | None:
    return (cluster._read_state() or {}).get("started")


def running() -> bool:
    """Whether Kueue runs for the rig that runs now (a Kueue of an earlier rig does not count)."""
    state = _read_state()
    if not state or state.get("rig_started") != _rig_started() or "ready" not in state:
        return False
    info = state["procs"]["kueue"]
    return state.get("feature_gates") == FEATURE_GATES and cluster._alive(info["pid"], info["exe"]) and _ready()


def _ready() -> bool:
    return cluster._http_ok(f"http://{cluster.HOST}:{cluster.PORTS['kueue-probe']}/readyz")


def up(rig: cluster.Rig) -> None:
    """Start Kueue for the running rig (or reuse it) and create the rig's flavors, ClusterQueue and the
    topology pool."""
    with cluster._flock("kueue.lock"):
        if running():
            cluster.log("reusing the running Kueue")
        else:
            stop()
            build.build(versions.KUEUE_BUILD_ORDER)
            start = time.monotonic()
            _start(rig)
            cluster.log(f"Kueue ready in {time.monotonic() - start:.1f}s; log in "
                        f"{cluster.run_dir() / 'logs' / 'kueue.log'}")
        _pool_up(rig)  # idempotent: also where a Kueue started before the pool existed is reused


def _pool_up(rig: cluster.Rig) -> None:
    """The topology pool's nodes (kwok makes them Ready), its Topology and flavor."""
    rig.apply([pool_node(n) for n in POOL_NODES])
    _apply_retrying(rig, [pool_topology(), pool_flavor()])
    ready = "{range .items[*]}{.status.conditions[?(@.type=='Ready')].status}{' '}{end}"
    rig.wait_for("the topology pool's kwok nodes Ready", lambda: rig.kubectl(
        "get", "nodes", "-l", f"{POOL_LABEL}=racks", "-o", f"jsonpath={ready}").stdout.split()
        == ["True"] * len(POOL_NODES), timeout=120)


def _start(rig: cluster.Rig) -> None:
    kd = kueue_dir()
    (kd / "certs").mkdir(parents=True, exist_ok=True)
    pkd = cluster.run_dir() / "pki"
    # The serving certificate, signed by the rig CA (the caBundle of every webhook configuration).
    pki.make_cert(pkd, "kueue-webhook", "ca", "/CN=kueue-webhook-service.kueue-system.svc", ips=(cluster.HOST,),
                  dns=("kueue-webhook-service.kueue-system.svc",))
    METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
    for folder in (kd / "certs", METRICS_CERT_DIR):
        for src, dst in (("kueue-webhook.crt", "tls.crt"), ("kueue-webhook.key", "tls.key")):
            tmp = folder / f".{dst}.{os.getpid()}"
            tmp.write_bytes((pkd / src).read_bytes())
            tmp.replace(folder / dst)  # atomically: a running Kueue of another rig may be reading
    (kd / "config.yaml").write_text(yaml.safe_dump(config()))
    rig.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(crds()))
    rig.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                *[f"crd/{c['metadata']['name']}" for c in crds()])
    procs: dict = {}
    state = {"procs": procs, "rig_started": _rig_started(), "feature_gates": FEATURE_GATES}
    exe = str(build.bin_dir(build.KUEUE) / "kueue")
    cluster._start("kueue", [exe, f"--config={kd / 'config.yaml'}", f"--feature-gates={FEATURE_GATES}",
                             f"--kubeconfig={rig.kubeconfig}", "--zap-log-level=info"], procs)
    _state_path().write_text(json.dumps(state))
    try:
        cluster._wait("Kueue", _ready, 120, procs, "kueue")
        # Registered once the webhook server listens, so no admission waits on a process still starting.
        rig.apply(webhook_configurations())
        # The webhooks check these objects: applying them proves the apiserver reaches Kueue.
        _apply_retrying(rig, [resource_flavor(), topology(), tas_flavor(),
                              cluster_queue(CLUSTER_QUEUE, cluster.GPUS_PER_NODE * len(cluster.GPU_NODES))])
    except BaseException:
        cluster._stop_procs(procs)
        raise
    state["ready"] = time.time()
    _state_path().write_text(json.dumps(state))


def _apply_retrying(rig: cluster.Rig, objects: list[dict], timeout: float = 60) -> None:
    """Apply through Kueue's webhooks, which answer once the manager has started its webhook server."""
    deadline = time.monotonic() + timeout
    while True:
        proc = rig.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects), check=False)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline or "webhook" not in proc.stderr:
            raise RuntimeError(f"applying Kueue's rig objects failed: {proc.stderr.strip()}")
        time.sleep(0.5)


def stop() -> None:
    """Stop Kueue if it runs (its webhook configurations stay only as long as the rig's etcd does)."""
    state = _read_state()
    if state:
        cluster._stop_procs(state.get("procs", {}))
        _state_path().unlink(missing_ok=True)
