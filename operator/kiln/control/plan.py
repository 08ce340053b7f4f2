"""plan(spec, observed, config) → the objects a TrainingSpec should have. Pure: no I/O, no clock.

One TrainingSpec becomes, all owned by it (deleting it deletes them):
  ServiceAccount/Role/RoleBinding `<name>-trainer`  rank 0 may get/patch this run's status, nothing else
  NetworkPolicy `<name>-trainer`                    only the run's own pods reach its pods (metrics port: the
                                                    monitoring namespace's pods)
  ConfigMap `<name>-spec`                           the resolved spec (every default filled), read by the pods
  PyTorchJob `<name>`                               kubeflow.org/v1, elastic, one Worker pod per node
With elastic.faultTolerance replicaGroups (kiln.trainer.membership.replica_groups), instead of that one PyTorchJob:
  PyTorchJob `<name>-g<i>`, i < groups               one per replica group, nodes / groups Worker pods each:
                                                    a group restarts alone, the others step on
  Deployment + Service `<name>-lighthouse`          torchft's lighthouse (the trainer image has it), which
                                                    forms each step's quorum of the live groups
  NetworkPolicy `<name>-lighthouse`                 only the run's trainer pods reach it
  Secret `<name>-ft`                                the run's secret, which the lighthouse asks each group to
                                                    prove (kiln.control.ft_secret; created once, never applied)
Every object is a plain dict ready for server-side apply; reconciling twice applies the same dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from kiln.api.presets import resolve_model
from kiln.api import contract
from kiln.api.contract import SPEC_FILE, SPEC_MOUNT, SPEC_PATH
from kiln.api.layout import fault_tolerance_groups, node_bounds, processes_per_node, replica_groups
from kiln.api.rules import check
from kiln.api.spec import API_VERSION, KIND, FaultToleranceSpec, TrainingSpec, TrainingSpecSpec
from kiln.control.config import OperatorConfig
from kiln.control.elastic import start_nodes, with_avoided_nodes
from kiln.control.k8s import K8S_MODELS, SERIALIZER
from kiln.control import ft_secret, pods
from kiln.control.kueue import LEFT_OUT_ANNOTATION, Coverage
from kiln.control.network import preset
from kiln.control.policy import violations
from kiln.errors import KilnError

k, _SERIALIZER = K8S_MODELS, SERIALIZER  # the kubeflow-training / kubernetes models, one shared Configuration

# libyaml's emitter when present (same text, ~4x faster: the largest cost of a plan in a burst)
SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

CONTAINER = "pytorch"  # the training-operator finds the container by this name
GPU = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_TOPOLOGY_ANNOTATION = {"required": "kueue.x-k8s.io/podset-required-topology",
                             "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass: Kueue's order and preemption
RUN_LABEL = "kiln.dev/trainingspec"
GROUP_LABEL = "kiln.dev/replica-group"  # replicaGroups: the group a trainer pod (and its PyTorchJob) belongs to
# The lighthouse pod is labelled apart from the trainer pods (not RUN_LABEL): it is no node of the run, so the
# status, the elastic loop and the pod watch, which all count the run's pods by RUN_LABEL, never see it.
LIGHTHOUSE_LABEL = "kiln.dev/lighthouse"
LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's own default
# A group whose heartbeats stop this long is left out of the next quorum (the steps of the others pause at
# most about this long); 1 s as in `kiln run` would drop a group for one slow network round trip between
# nodes. A new quorum waits this long for groups still joining once one group is ready.
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 2000
LIGHTHOUSE_JOIN_TIMEOUT_MS = 1000
LIGHTHOUSE_MEMORY = "128Mi"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln"}
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SHM_DIR = "/dev/shm/kiln"  # KILN_SHM_DIR: each node's copy of the newest commit (kiln.trainer.checkpoint.host_copy)
# torchrun forwards SIGTERM to the ranks, then SIGKILLs them after PET_SHUTDOWN_TIMEOUT (its default: 30 s);
# it must fit in the pod's grace period with this margin for torchrun's own exit.
SHUTDOWN_MARGIN_S = 10
# torchrun restarts the ranks in place (elasticPolicy.maxRestarts). With its default shared TCP store a
# restarted generation can read the dead one's gloo addresses (connectFullMesh refused, then a hang until
# the store timeout; tests/distributed/test_torchrun_restart.py): a fresh store per rendezvous round.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# The trainer's root filesystem is read-only (Pod Security `restricted`): everything it, torch, Triton and
# the compile caches write goes to two emptyDirs, /tmp and the scratch dir (checkpoints when no uri is set,
# the run folder with metrics, the downloaded data shards).
TMP_DIR = "/tmp"
WRITABLE_ENV = {
    "TMPDIR": TMP_DIR,
    "XDG_CACHE_HOME": f"{TMP_DIR}/cache",
    "TORCHINDUCTOR_CACHE_DIR": f"{TMP_DIR}/torchinductor",
    "TRITON_HOME": TMP_DIR,
    "TRITON_CACHE_DIR": f"{TMP_DIR}/triton",
}

# Changing these under a running job would silently break it (the checkpoint no longer fits the model,
# the data cursor no longer means anything): the operator refuses the change instead of applying it.
# What a request left out (queue_fit) costs the run, said in SpecAccepted's message.
LEFT_OUT_WHY = {"ephemeral-storage": "; the trainer still refuses data shards that do not fit the node's free disk",
                "memory": "; the pod has no memory limit and /dev/shm is bounded by the operator's default memory"}

IMMUTABLE_WHILE_RUNNING = (
    ("model",), ("data", "uri"), ("parallelism", "tensor"), ("parallelism", "pipeline"),
    ("resources", "gpusPerNode"), ("resources", "processesPerNode"),
    ("elastic", "faultTolerance"),  # one PyTorchJob or one per group: the running ones would stay beside the new
)


@dataclass(frozen=True)
class Observed:
    """What the operator saw in the cluster that the plan depends on."""

    applied: dict | None = None  # the resolved spec in the existing ConfigMap (what the job runs with)
    job_active: bool = False  # a PyTorchJob exists and has not finished
    nodes: int | None = None  # the elastic controller's current node decision; None: spec.resources.nodes
    avoid_nodes: tuple[str, ...] = ()  # nodes that failed this run twice (kiln.control.elastic)
    queue_coverage: Coverage | None = None  # what the run's ClusterQueue covers (None: not known, or no queue)
    left_out: tuple[str, ...] | None = None  # the requests left out of the live job (None: no live job)


@dataclass
class Plan:
    objects: list[dict[str, Any]] = field(default_factory=list)
    refused: str | None = None  # why nothing is applied: a spec change the running job cannot absorb, or ...
    refused_reason: str = "ImmutableFieldChanged"  # ... ForbiddenByPolicy (kiln.control.policy), NotCoveredByQueue
    notes: list[str] = field(default_factory=list)  # what the user should know about an applied plan


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1e-3}


def quantity_bytes(quantity: str) -> int:
    """A byte quantity as the API takes it (kiln.api.spec.QUANTITY: 50Gi, 100G, 1000000) in bytes."""
    number = quantity.rstrip("kKMGTPEim")
    return int(float(number) * _SUFFIX[quantity[len(number):]])


def pod_resources(s: TrainingSpecSpec, config: OperatorConfig) -> dict[str, tuple[str, str | None]]:
    """What each trainer pod requests: resource → (quantity, the spec field that asks for it, or None for
    kiln's own default). Never a BestEffort pod (the first evicted): without spec cpu/memory the operator's
    defaults apply; local disk always (the kubelet evicts a pod past it; the trainer refuses data that
    cannot fit first, KILN_DATA_CACHE_BYTES)."""
    r = s.resources
    out: dict[str, tuple[str, str | None]] = {}
    if r.gpus_per_node:
        out[GPU] = (str(r.gpus_per_node), "resources.gpusPerNode")
    out["cpu"] = (r.cpu, "resources.cpu") if r.cpu else (config.default_cpu, None)
    out["memory"] = (r.memory, "resources.memory") if r.memory else (config.default_memory, None)
    out["ephemeral-storage"] = (r.ephemeral_storage, "resources.ephemeralStorage") if r.ephemeral_storage \
        else (config.default_ephemeral_storage, None)
    # extended resources (devices, huge pages): request = limit, as Kubernetes requires
    out |= {name: (quantity, "network.fabric") for name, quantity in preset(s.network).resources.items()}
    out |= {r.name: (r.quantity, f"pod.extraResources[{i}]") for i, r in enumerate(s.pod.extra_resources)}
    return out


def queue_fit(s: TrainingSpecSpec, config: OperatorConfig, observed: Observed) -> tuple[tuple[str, ...], list[str]]:
    """(requests to leave out, refusals) so that the run's ClusterQueue can admit it: Kueue never admits a
    pod set with a request its ClusterQueue does not cover, and says so only in the Workload. kiln's own
    defaults the queue does not cover are left out; a request the spec asks for is refused by field, with
    both fixes. A live job keeps what was left out when it was made (docs/scheduling.md)."""
    if observed.left_out is not None:
        return observed.left_out, []
    cov = observed.queue_coverage
    if cov is None:
        return (), []
    left_out, refusals = [], []
    for resource, (_, spec_field) in pod_resources(s, config).items():
        if cov.covers(resource):
            continue
        if spec_field is None:
            left_out.append(resource)
        else:
            refusals.append(
                f"spec.{spec_field}: the pods request {resource}, which ClusterQueue {cov.cluster_queue} (behind "
                f"LocalQueue {s.scheduling.queue}) does not cover, so Kueue would never admit the run; add "
                f"{resource} to the ClusterQueue's coveredResources with a quota, or leave spec.{spec_field} unset")
    return tuple(left_out), refusals


def names(run: str) -> dict[str, str]:
    return {"job": run, "configmap": f"{run}-spec", "trainer": f"{run}-trainer", "lighthouse": f"{run}-lighthouse"}


def job_names(run: str, groups: int = 1) -> list[str]:
    """The run's PyTorchJobs: `<run>`, or with replica groups `<run>-g0` .. `<run>-g<groups-1>`."""
    return [run] if groups <= 1 else [group_job_name(run, i) for i in range(groups)]


def group_job_name(run: str, group: int) -> str:
    """The PyTorchJob of one replica group."""
    return f"{run}-g{group}"


def job_names_of(body: dict) -> list[str]:
    """job_names for a TrainingSpec as stored (not validated yet: a malformed faultTolerance counts as off)."""
    raw = ((body.get("spec") or {}).get("elastic") or {}).get("faultTolerance")
    try:  # the section's own validation bounds groups (MAX_REPLICA_GROUPS)
        groups = fault_tolerance_groups(FaultToleranceSpec.model_validate(raw)) if raw else None
    except ValidationError:
        groups = None
    return job_names(body["metadata"]["name"], groups or 1)


def topology_annotations(s: TrainingSpecSpec) -> dict[str, str] | None:
    """Kueue's pod-set topology request on the worker template (None: no scheduling.topology)."""
    t = s.scheduling.topology
    return {KUEUE_TOPOLOGY_ANNOTATION[t.mode]: t.level} if t else None


def resolve(doc: TrainingSpec, config: OperatorConfig) -> TrainingSpec:
    """The spec with every default made explicit: what the pods run with (and what `kiln render` shows)."""
    s = doc.spec
    # model.from: the dimensions are in the folder's config.json, which the trainer reads (kiln.trainer.model.hf_folder)
    model = s.model if s.model.from_ else s.model.model_copy(update=resolve_model(s.model).model_dump())
    lo, hi = node_bounds(s)
    uri = s.checkpoint.uri or f"file://{config.scratch_dir}/checkpoints/"
    spec = s.model_copy(update={
        "image": s.image or config.image,
        "model": model,
        "resources": s.resources.model_copy(update={"processes_per_node": processes_per_node(s)}),
        "elastic": s.elastic.model_copy(update={"min_nodes": lo, "max_nodes": hi}),
        "checkpoint": s.checkpoint.model_copy(update={"uri": uri}),
    }, deep=True)
    meta = {"name": doc.metadata.name}
    if doc.metadata.namespace:
        meta["namespace"] = doc.metadata.namespace
    return TrainingSpec.model_validate({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                                        "spec": spec.model_dump(by_alias=True, exclude_none=True)})


def dump(doc: TrainingSpec) -> dict:
    return doc.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})


def immutable_changes(applied: dict, resolved: dict) -> list[str]:
    """'spec.<path> (old → new)' for every leaf of IMMUTABLE_WHILE_RUNNING that differs."""
    changed: list[str] = []

    def diff(path: str, old: Any, new: Any) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in dict.fromkeys([*old, *new]):
                diff(f"{path}.{key}", old.get(key), new.get(key))
        elif old != new:
            changed.append(f"{path} ({json.dumps(old)} → {json.dumps(new)})")

    for path in IMMUTABLE_WHILE_RUNNING:
        old, new = applied.get("spec", {}), resolved.get("spec", {})
        for key in path:
            old, new = (old or {}).get(key), (new or {}).get(key)
        diff("spec." + ".".join(path), old, new)
    return changed


def plan(doc: TrainingSpec, observed: Observed | None = None, config: OperatorConfig | None = None) -> Plan:
    """The desired objects for one TrainingSpec (metadata needs name, namespace and, in a cluster, uid)."""
    observed = observed or Observed()
    config = config or OperatorConfig()
    problems = check(doc.spec, scope="all")
    if problems:  # the apiserver's CEL refuses these too; reached by `kiln render` or a CRD without rules
        raise KilnError("\n".join(problems))
    forbidden = violations(doc.spec, config.policy, config.image)
    if forbidden:
        return Plan(refused="; ".join(forbidden), refused_reason="ForbiddenByPolicy")
    left_out, uncovered = queue_fit(doc.spec, config, observed)
    if uncovered:  # refused whole: a job Kueue can never admit would sit Queued for ever
        return Plan(refused="; ".join(uncovered), refused_reason="NotCoveredByQueue")
    notes = [f"the pods do not request {r} (kiln's default; ClusterQueue {observed.queue_coverage.cluster_queue} "
             f"does not cover it){LEFT_OUT_WHY.get(r, '')}" for r in left_out if observed.queue_coverage]
    level, needs = pods.security_level(doc.spec)
    if level != "restricted":  # allowed by the admin policy (checked above); the namespace must allow it too
        notes.append(f"the pods need Pod Security level {level} ({pods.LEVEL_LABEL}: {level} on the namespace): "
                     + ", ".join(needs))
    resolved = resolve(doc, config)
    resolved_dict = dump(resolved)
    if observed.applied is not None and observed.job_active:
        changed = immutable_changes(observed.applied, resolved_dict)
        if changed:
            return Plan(refused="the running job cannot absorb a change of " + ", ".join(changed)
                        + "; revert it, or delete the TrainingSpec and create a new run")
    meta = doc.metadata
    extra = meta.model_extra or {}
    owner = None
    if extra.get("uid"):
        owner = {"apiVersion": API_VERSION, "kind": KIND, "name": meta.name, "uid": extra["uid"],
                 "controller": True, "blockOwnerDeletion": True}
    n = names(meta.name)

    def metadata(name: str, labels: dict | None = None) -> dict:
        m: dict[str, Any] = {"name": name, "labels": {**MANAGED_BY, RUN_LABEL: meta.name, **(labels or {})}}
        if meta.namespace:
            m["namespace"] = meta.namespace
        if owner:
            m["ownerReferences"] = [owner]
        return m

    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(n["configmap"]),
                 "data": {SPEC_FILE: yaml.dump(resolved_dict, Dumper=SafeDumper, sort_keys=False)}}
    groups = replica_groups(resolved.spec)
    # the names once: per job it was O(groups) each, O(groups²) a plan (16,000 groups: 45 s of CPU)
    job_name = job_names(meta.name, groups)
    if groups == 1:
        jobs = [pytorchjob(resolved, observed, config, metadata, job_name[0])]
    else:  # the secret and the lighthouse before the jobs: a group's first quorum asks it
        jobs = [ft_secret.secret(meta.name, metadata), *lighthouse(resolved, config, metadata),
                *(pytorchjob(resolved, observed, config, metadata, job_name[i], group=i) for i in range(groups))]
    return Plan(objects=[*trainer_identity(meta.name, metadata, doc.spec.pod.service_account_name),
                         trainer_network_policy(meta.name, metadata, config),
                         configmap, *jobs], notes=notes)


def trainer_network_policy(run: str, metadata, config: OperatorConfig) -> dict:
    """Only this run's own pods may connect to its pods: the rendezvous store (torch's TCPStore has no
    authentication) and the collectives' ports would otherwise take connections from any pod of any tenant.
    Rank 0's metrics port (its metrics name the run's data) is open to the monitoring namespace's pods only.
    Enforced where the cluster's network plugin implements NetworkPolicy; elsewhere the object is inert."""
    pods = {"matchLabels": {RUN_LABEL: run}}
    ingress: list[dict] = [{"from": [{"podSelector": pods}]}]
    if config.trainer_metrics_port and config.monitoring_namespace:
        scrapers = {"matchLabels": {"kubernetes.io/metadata.name": config.monitoring_namespace}}
        ingress.append({"from": [{"namespaceSelector": scrapers}],
                        "ports": [{"protocol": "TCP", "port": config.trainer_metrics_port}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata(names(run)["trainer"]),
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}}


def trainer_identity(run: str, metadata, service_account: str | None = None) -> list[dict]:
    """The pods' ServiceAccount: allowed to read and patch the status of this one TrainingSpec. With
    pod.serviceAccountName the pods run as that one instead, which the RoleBinding then grants the same."""
    name = names(run)["trainer"]
    subjects = [{"kind": "ServiceAccount", "name": name}]
    if service_account and service_account != name:
        subjects.append({"kind": "ServiceAccount", "name": service_account})
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata(name),
         "rules": [{"apiGroups": ["kiln.dev"], "resources": ["trainingspecs/status"], "resourceNames": [run],
                    "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": metadata(name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": subjects},
    ]


def pytorchjob(doc: TrainingSpec, observed: Observed, config: OperatorConfig, metadata, name: str,
               group: int | None = None) -> dict:
    """The PyTorchJob `name` for a resolved spec, built with the kubeflow-training models; with `group`, the one
    of that replica group: nodes / groups workers, at a fixed size, told the lighthouse and its group number."""
    s: TrainingSpecSpec = doc.spec
    r, run = s.resources, doc.metadata.name
    n = names(run)
    groups = replica_groups(s)
    replicas = observed.nodes or start_nodes(s) if group is None else r.nodes // groups
    low, high = (s.elastic.min_nodes, s.elastic.max_nodes) if group is None else (replicas, replicas)
    ppn = r.processes_per_node

    left_out, _ = queue_fit(s, config, observed)
    wanted = {name: q for name, q in pod_resources(s, config).items() if name not in left_out}
    requests = {name: quantity for name, (quantity, _) in wanted.items()}
    # cpu: a request, a limit only when the spec sets one (no throttling by default); the rest request = limit
    limits = {name: quantity for name, (quantity, spec_field) in wanted.items() if name != "cpu" or spec_field}
    memory = r.memory or config.default_memory  # /dev/shm (tmpfs) is bounded by it
    disk = requests.get("ephemeral-storage")
    node_selector = dict(r.node_selector)
    if r.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = r.gpu_type
    tolerations = [k.V1Toleration(**t.model_dump(exclude_none=True)) for t in r.tolerations]
    if r.gpus_per_node and not any(t.key == GPU for t in r.tolerations):
        # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule to keep other pods off them.
        tolerations.append(k.V1Toleration(key=GPU, operator="Exists", effect="NoSchedule"))

    env = [
        k.V1EnvVar(name=contract.RUN_NAME, value=run),
        k.V1EnvVar(name=contract.NAMESPACE, value_from=k.V1EnvVarSource(
            field_ref=k.V1ObjectFieldSelector(field_path="metadata.namespace"))),
        # names this node's GPUs in status.gpuHealth, which the operator's failover reads
        k.V1EnvVar(name=contract.NODE_NAME, value_from=k.V1EnvVarSource(
            field_ref=k.V1ObjectFieldSelector(field_path="spec.nodeName"))),
    ]
    if s.checkpoint.credentials_secret:  # by reference: the key never appears in any object kiln writes
        env += [k.V1EnvVar(name=key, value_from=k.V1EnvVarSource(
            secret_key_ref=k.V1SecretKeySelector(name=s.checkpoint.credentials_secret, key=key)))
            for key in S3_KEYS]
    if s.checkpoint.endpoint:
        env.append(k.V1EnvVar(name="AWS_ENDPOINT_URL", value=s.checkpoint.endpoint))
    env += tracking_env(s.tracking)
    # SIGTERM (suspend, scale-down, preemption) → the ranks agree on a step and save it: torchrun must not
    # SIGKILL them before the pod's grace period would.
    env.append(k.V1EnvVar(name="PET_SHUTDOWN_TIMEOUT",
                          value=str(max(1, config.termination_grace_seconds - SHUTDOWN_MARGIN_S))))
    env += [k.V1EnvVar(name=key, value=value) for key, value in TORCHRUN_ENV.items()]
    env += [k.V1EnvVar(name=key, value=value) for key, value in WRITABLE_ENV.items()]
    env.append(k.V1EnvVar(name=contract.DATA_CACHE, value=f"{config.scratch_dir}/data"))
    if disk:  # without a request (left out for the queue) the trainer checks the disk's free space only
        env.append(k.V1EnvVar(name=contract.DATA_CACHE_BYTES, value=str(quantity_bytes(disk))))
    if group is not None:  # kiln.trainer.membership.replica_groups: every group's rank 0 heartbeats to the lighthouse
        env += [k.V1EnvVar(name=contract.FT_LIGHTHOUSE, value=lighthouse_address(run)),
                k.V1EnvVar(name=contract.FT_GROUP, value=str(group)), ft_secret.env()]
    ports = [k.V1ContainerPort(name="c10d", container_port=config.rdzv_port)]
    if config.trainer_metrics_port:  # rank 0's Prometheus /metrics, on a named port for a PodMonitor
        env.append(k.V1EnvVar(name=contract.METRICS_PORT, value=str(config.trainer_metrics_port)))
        ports.append(k.V1ContainerPort(name="metrics", container_port=config.trainer_metrics_port))
    # A restarted container resumes from host memory instead of downloading (docs/checkpoints.md); not for
    # the scratch default, which is on this pod's disk already.
    to_store = not s.checkpoint.uri.startswith(f"file://{config.scratch_dir}/")
    if to_store:
        env.append(k.V1EnvVar(name=contract.SHM_DIR, value=SHM_DIR))
    env += pods.env(s)  # the network preset's and pod.env (which never names one of kiln's above)
    user_volumes, user_mounts = pods.volumes(s.pod)
    if group is not None:  # the run's secret, as a file: only this run's groups and its lighthouse mount it
        user_volumes, user_mounts = [ft_secret.volume(run), *user_volumes], [ft_secret.mount(), *user_mounts]

    container = k.V1Container(
        name=CONTAINER,
        image=s.image,
        image_pull_policy=config.image_pull_policy,
        # torchrun takes nnodes, nproc-per-node, rendezvous and max-restarts from the PET_* variables
        # that the training-operator sets from elasticPolicy and nprocPerNode.
        # `kiln torchrun`: torchrun, exiting 128+signal when the pod is stopped, so the ExitCode policy retries.
        # kiln.cli.warm: `kiln train`, each rank forked from a process that holds the imports, so a restart
        # of the ranks in place does not pay for importing torch again (docs/resilience.md).
        command=["kiln", "torchrun", "-m", "kiln.cli.warm", "train", "--config", SPEC_PATH,
                 "--output", f"{config.scratch_dir}/run"],
        env=env,
        ports=ports,
        resources=k.V1ResourceRequirements(limits=limits, requests=requests),
        volume_mounts=[
            k.V1VolumeMount(name="spec", mount_path=SPEC_MOUNT, read_only=True),
            k.V1VolumeMount(name="dshm", mount_path="/dev/shm"),  # NCCL and dataloaders need more than 64Mi
            k.V1VolumeMount(name="scratch", mount_path=config.scratch_dir),
            k.V1VolumeMount(name="tmp", mount_path=TMP_DIR),
            *user_mounts,
        ],
        # Pod Security `restricted`: the trainer needs no privilege, no capability and no writable root; what
        # pod.capabilities and the network preset add (RDMA: IPC_LOCK) only as the admin policy allows.
        security_context=k.V1SecurityContext(
            allow_privilege_escalation=False,
            capabilities=k.V1Capabilities(drop=["ALL"], add=pods.capabilities(s) or None),
            read_only_root_filesystem=True,
        ),
    )
    pod = k.V1PodSpec(
        containers=[container],
        service_account_name=s.pod.service_account_name or n["trainer"],
        image_pull_secrets=[k.V1LocalObjectReference(name=x.name) for x in s.pod.image_pull_secrets] or None,
        runtime_class_name=s.pod.runtime_class_name,
        host_network=s.pod.host_network or None,
        host_ipc=s.pod.host_ipc or None,
        # on the node's network the pod still resolves the rendezvous Service's name
        dns_policy="ClusterFirstWithHostNet" if s.pod.host_network else None,
        # The image's USER must be numeric and non-root (kiln's trainer image runs as 10001).
        security_context=k.V1PodSecurityContext(
            run_as_non_root=True, seccomp_profile=k.V1SeccompProfile(type="RuntimeDefault")),
        node_selector=node_selector or None,
        tolerations=tolerations or None,
        # passed through as written (a core/v1 Affinity), plus keeping off nodes that failed this run twice
        affinity=with_avoided_nodes(r.affinity, observed.avoid_nodes),
        priority_class_name=s.scheduling.priority_class_name,
        termination_grace_period_seconds=config.termination_grace_seconds,
        volumes=[
            k.V1Volume(name="spec", config_map=k.V1ConfigMapVolumeSource(name=n["configmap"])),
            # tmpfs counts against the container's memory limit: bounded by it, never more
            k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory",
                                                                      size_limit=s.pod.shm_size or memory)),
            k.V1Volume(name="scratch", empty_dir=k.V1EmptyDirVolumeSource()),
            k.V1Volume(name="tmp", empty_dir=k.V1EmptyDirVolumeSource()),
            *user_volumes,
        ],
    )
    group_label = {} if group is None else {GROUP_LABEL: str(group)}
    template = k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels={**MANAGED_BY, RUN_LABEL: run, **group_label},
                                                           annotations=topology_annotations(s)), spec=pod)

    scheduling = None
    if s.scheduling.gang or s.scheduling.queue or s.scheduling.priority_class_name:
        scheduling = k.KubeflowOrgV1SchedulingPolicy(
            min_available=low if s.scheduling.gang else None,
            queue=s.scheduling.queue,
            priority_class=s.scheduling.priority_class_name,
        )
    # With a queue, Kueue owns runPolicy.suspend (it unsuspends on admission): kiln sets it only to suspend.
    suspend = True if s.suspend else (None if s.scheduling.queue else False)
    job = k.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=None,
        spec=k.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(ppn),
            elastic_policy=k.KubeflowOrgV1ElasticPolicy(
                min_replicas=low,
                max_replicas=high,
                rdzv_backend="c10d",
                rdzv_port=config.rdzv_port,
                max_restarts=s.elastic.max_restarts,
            ),
            run_policy=k.KubeflowOrgV1RunPolicy(
                backoff_limit=s.elastic.max_restarts,
                clean_pod_policy=config.clean_pod_policy,
                suspend=suspend,
                scheduling_policy=scheduling,
            ),
            pytorch_replica_specs={"Worker": k.KubeflowOrgV1ReplicaSpec(
                replicas=replicas, restart_policy="ExitCode", template=template)},
        ),
    )
    body = _SERIALIZER.sanitize_for_serialization(job)
    labels = {KUEUE_QUEUE_LABEL: s.scheduling.queue} if s.scheduling.queue else {}
    if s.scheduling.priority:
        labels[KUEUE_PRIORITY_LABEL] = s.scheduling.priority
    labels = {**labels, **group_label} or None
    body["metadata"] = metadata(name, labels)
    if left_out:
        body["metadata"]["annotations"] = {LEFT_OUT_ANNOTATION: ",".join(left_out)}
    return body


def lighthouse_address(run: str) -> str:
    """KILN_FT_LIGHTHOUSE: the lighthouse's Service, in the run's namespace."""
    return f"http://{names(run)['lighthouse']}:{LIGHTHOUSE_PORT}"


def lighthouse(doc: TrainingSpec, config: OperatorConfig, metadata) -> list[dict]:
    """torchft's lighthouse for a run with replica groups: a NetworkPolicy (only the run's trainer pods reach
    it), a ClusterIP Service and a one-replica Deployment running torchft's lighthouse (`kiln-lighthouse`) from
    the trainer image.
    A Deployment, not a pod of a group's job: it must outlive any group's restart. It keeps no state a
    restart loses for good: the groups' next quorum requests form the quorum again."""
    run, s = doc.metadata.name, doc.spec
    name = names(run)["lighthouse"]
    selector = {LIGHTHOUSE_LABEL: run}
    container = k.V1Container(
        name="lighthouse",
        image=s.image,
        image_pull_policy=config.image_pull_policy,
        # kiln's entry to torchft's server: torchft's own console script imports torch first (kiln.cli.lighthouse)
        command=["kiln-lighthouse", "--min_replicas", "1",  # one live group keeps training
                 "--join_timeout_ms", str(LIGHTHOUSE_JOIN_TIMEOUT_MS),
                 "--heartbeat_timeout_ms", str(LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS),
                 "--quorum_tick_ms", str(contract.FT_QUORUM_TICK_MS),
                 "--bind", f"[::]:{LIGHTHOUSE_PORT}",
                 "--secret_file", ft_secret.FILE],  # the port admits only holders of the run's secret
        env=[k.V1EnvVar(name="RUST_LOG", value="warn")],  # torchft logs every quorum at info
        volume_mounts=[ft_secret.mount()],
        ports=[k.V1ContainerPort(name="lighthouse", container_port=LIGHTHOUSE_PORT)],
        # a small Rust server: ~14 MB resident without torch (torchft's own script imported it: ~620 MB, and
        # 256Mi was OOMKilled on the rig's real node). Burstable, never BestEffort (the first evicted).
        resources=k.V1ResourceRequirements(requests={"cpu": "100m", "memory": LIGHTHOUSE_MEMORY},
                                           limits={"memory": LIGHTHOUSE_MEMORY}),
        readiness_probe=k.V1Probe(tcp_socket=k.V1TCPSocketAction(port=LIGHTHOUSE_PORT), period_seconds=5),
        security_context=k.V1SecurityContext(allow_privilege_escalation=False,
                                             capabilities=k.V1Capabilities(drop=["ALL"]),
                                             read_only_root_filesystem=True),
    )
    pod = k.V1PodSpec(
        containers=[container],
        automount_service_account_token=False,  # it talks to no apiserver
        volumes=[ft_secret.volume(run)],
        # the trainer image: pulled with the trainer pods' secrets
        image_pull_secrets=[k.V1LocalObjectReference(name=x.name) for x in s.pod.image_pull_secrets] or None,
        security_context=k.V1PodSecurityContext(run_as_non_root=True,
                                                seccomp_profile=k.V1SeccompProfile(type="RuntimeDefault")),
        # the pools the spec names (resources.nodeSelector, tolerations), where the groups' pods reach it; not
        # the GPU product selector nor the GPU toleration: it uses no GPU
        node_selector=dict(s.resources.node_selector) or None,
        tolerations=[k.V1Toleration(**t.model_dump(exclude_none=True)) for t in s.resources.tolerations] or None,
        priority_class_name=s.scheduling.priority_class_name,
    )
    template = {"metadata": {"labels": {**MANAGED_BY, **selector}}, "spec": _SERIALIZER.sanitize_for_serialization(pod)}
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata(name),
         "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {RUN_LABEL: run}}}],
                               "ports": [{"protocol": "TCP", "port": LIGHTHOUSE_PORT}]}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name),
         "spec": {"selector": selector, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT,
                                                   "targetPort": LIGHTHOUSE_PORT, "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(name),
         "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                  "strategy": {"type": "Recreate"},  # never two lighthouses, each with half the groups
                  "template": template}},
    ]


def tracking_env(tracking) -> list:
    """The trackers' credentials by reference (optional keys), never their values."""
    if tracking is None:
        return []
    wanted = [(t.credentials_secret, keys) for t, keys in ((tracking.mlflow, contract.MLFLOW_SECRET_KEYS),
                                                           (tracking.wandb, contract.WANDB_SECRET_KEYS))
              if t is not None and t.credentials_secret]
    return [k.V1EnvVar(name=key, value_from=k.V1EnvVarSource(secret_key_ref=k.V1SecretKeySelector(
        name=secret, key=key, optional=True))) for secret, keys in wanted for key in keys]
