"""plan(spec, observed, config) → the objects a TrainingSpec should have. Pure: no I/O, no clock.

One TrainingSpec becomes, all owned by it (deleting it deletes them):
  ServiceAccount/Role/RoleBinding `<name>-trainer`  rank 0 may get/patch this run's status, nothing else
  NetworkPolicy `<name>-trainer`                    only the run's own pods reach its pods (metrics port: anyone)
  ConfigMap `<name>-spec`                           the resolved spec (every default filled), read by the pods
  PyTorchJob `<name>`                               kubeflow.org/v1, elastic, one Worker pod per node
Every object is a plain dict ready for server-side apply; reconciling twice applies the same dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubeflow.training import ApiClient
from kubeflow.training import models as k

from kiln.api.presets import resolve_model
from kiln.api import contract
from kiln.api.contract import SPEC_FILE, SPEC_MOUNT, SPEC_PATH
from kiln.api.layout import node_bounds, processes_per_node
from kiln.api.rules import check
from kiln.api.spec import API_VERSION, KIND, TrainingSpec, TrainingSpecSpec
from kiln.control.config import OperatorConfig
from kiln.control.elastic import with_avoided_nodes
from kiln.control.policy import violations
from kiln.errors import KilnError

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
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln"}
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SHM_DIR = "/dev/shm/kiln"  # KILN_SHM_DIR: each node's copy of the newest commit (kiln.trainer.shm_copy)
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
IMMUTABLE_WHILE_RUNNING = (
    ("model",), ("data", "uri"), ("parallelism", "tensor"), ("parallelism", "pipeline"),
    ("resources", "gpusPerNode"), ("resources", "processesPerNode"),
)


@dataclass(frozen=True)
class Observed:
    """What the operator saw in the cluster that the plan depends on."""

    applied: dict | None = None  # the resolved spec in the existing ConfigMap (what the job runs with)
    job_active: bool = False  # a PyTorchJob exists and has not finished
    nodes: int | None = None  # the elastic controller's current node decision; None: spec.resources.nodes
    avoid_nodes: tuple[str, ...] = ()  # nodes that failed this run twice (kiln.control.elastic)


@dataclass
class Plan:
    objects: list[dict[str, Any]] = field(default_factory=list)
    refused: str | None = None  # why nothing is applied: a spec change the running job cannot absorb, or ...
    refused_reason: str = "ImmutableFieldChanged"  # ... ForbiddenByPolicy (kiln.control.policy)


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1e-3}


def quantity_bytes(quantity: str) -> int:
    """A byte quantity as the API takes it (kiln.api.spec.QUANTITY: 50Gi, 100G, 1000000) in bytes."""
    number = quantity.rstrip("kKMGTPEim")
    return int(float(number) * _SUFFIX[quantity[len(number):]])


def names(run: str) -> dict[str, str]:
    return {"job": run, "configmap": f"{run}-spec", "trainer": f"{run}-trainer"}


def topology_annotations(s: TrainingSpecSpec) -> dict[str, str] | None:
    """Kueue's pod-set topology request on the worker template (None: no scheduling.topology)."""
    t = s.scheduling.topology
    return {KUEUE_TOPOLOGY_ANNOTATION[t.mode]: t.level} if t else None


def resolve(doc: TrainingSpec, config: OperatorConfig) -> TrainingSpec:
    """The spec with every default made explicit: what the pods run with (and what `kiln render` shows)."""
    s = doc.spec
    # model.from: the dimensions are in the folder's config.json, which the trainer reads (kiln.trainer.hf)
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
    ft = doc.spec.elastic.fault_tolerance
    if ft is not None and ft.mode == "replicaGroups":  # refused whole: never a job that cannot start
        return Plan(refused="elastic.faultTolerance.mode replicaGroups is not rendered by the operator yet (it needs "
                            "one PyTorchJob per replica group and the torchft lighthouse); on Kubernetes use mode off, "
                            "or run the groups with torchrun (docs/resilience.md, Replica groups)",
                    refused_reason="NotSupported")
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
    return Plan(objects=[*trainer_identity(meta.name, metadata), trainer_network_policy(meta.name, metadata, config),
                         configmap,
                         pytorchjob(resolved, observed, config, metadata)])


def trainer_network_policy(run: str, metadata, config: OperatorConfig) -> dict:
    """Only this run's own pods may connect to its pods: the rendezvous store (torch's TCPStore has no
    authentication) and the collectives' ports would otherwise take connections from any pod of any tenant.
    Rank 0's metrics port stays open to scrapers. Enforced where the cluster's network plugin implements
    NetworkPolicy; elsewhere the object is inert."""
    pods = {"matchLabels": {RUN_LABEL: run}}
    ingress: list[dict] = [{"from": [{"podSelector": pods}]}]
    if config.trainer_metrics_port:
        ingress.append({"ports": [{"protocol": "TCP", "port": config.trainer_metrics_port}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata(names(run)["trainer"]),
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}}


def trainer_identity(run: str, metadata) -> list[dict]:
    """The pods' ServiceAccount: allowed to read and patch the status of this one TrainingSpec."""
    name = names(run)["trainer"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata(name),
         "rules": [{"apiGroups": ["kiln.dev"], "resources": ["trainingspecs/status"], "resourceNames": [run],
                    "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": metadata(name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def pytorchjob(doc: TrainingSpec, observed: Observed, config: OperatorConfig, metadata) -> dict:
    """The PyTorchJob for a resolved spec, built with the kubeflow-training models."""
    s: TrainingSpecSpec = doc.spec
    r, run = s.resources, doc.metadata.name
    n = names(run)
    replicas = observed.nodes or r.nodes
    ppn = r.processes_per_node

    # Never a BestEffort pod (the first evicted): without spec cpu/memory the operator's defaults apply, as a
    # cpu request (no limit: no throttling) and a memory request = limit, which also bounds /dev/shm.
    limits: dict[str, str] = {}
    if r.gpus_per_node:
        limits[GPU] = str(r.gpus_per_node)
    if r.cpu:
        limits["cpu"] = r.cpu
    memory = r.memory or config.default_memory
    limits["memory"] = memory
    # the kubelet evicts a pod past this; the trainer refuses data that cannot fit first (KILN_DATA_CACHE_BYTES)
    disk = r.ephemeral_storage or config.default_ephemeral_storage
    limits["ephemeral-storage"] = disk
    requests = {**limits, "cpu": r.cpu or config.default_cpu}
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
    ]
    if s.checkpoint.credentials_secret:  # by reference: the key never appears in any object kiln writes
        env += [k.V1EnvVar(name=key, value_from=k.V1EnvVarSource(
            secret_key_ref=k.V1SecretKeySelector(name=s.checkpoint.credentials_secret, key=key)))
            for key in S3_KEYS]
    if s.checkpoint.endpoint:
        env.append(k.V1EnvVar(name="AWS_ENDPOINT_URL", value=s.checkpoint.endpoint))
    # SIGTERM (suspend, scale-down, preemption) → the ranks agree on a step and save it: torchrun must not
    # SIGKILL them before the pod's grace period would.
    env.append(k.V1EnvVar(name="PET_SHUTDOWN_TIMEOUT",
                          value=str(max(1, config.termination_grace_seconds - SHUTDOWN_MARGIN_S))))
    env += [k.V1EnvVar(name=key, value=value) for key, value in TORCHRUN_ENV.items()]
    env += [k.V1EnvVar(name=key, value=value) for key, value in WRITABLE_ENV.items()]
    env.append(k.V1EnvVar(name=contract.DATA_CACHE, value=f"{config.scratch_dir}/data"))
    env.append(k.V1EnvVar(name=contract.DATA_CACHE_BYTES, value=str(quantity_bytes(disk))))
    ports = [k.V1ContainerPort(name="c10d", container_port=config.rdzv_port)]
    if config.trainer_metrics_port:  # rank 0's Prometheus /metrics, on a named port for a PodMonitor
        env.append(k.V1EnvVar(name=contract.METRICS_PORT, value=str(config.trainer_metrics_port)))
        ports.append(k.V1ContainerPort(name="metrics", container_port=config.trainer_metrics_port))
    # A restarted container resumes from host memory instead of downloading (docs/checkpoints.md); not for
    # the scratch default, which is on this pod's disk already.
    to_store = not s.checkpoint.uri.startswith(f"file://{config.scratch_dir}/")
    if to_store:
        env.append(k.V1EnvVar(name=contract.SHM_DIR, value=SHM_DIR))

    container = k.V1Container(
        name=CONTAINER,
        image=s.image,
        image_pull_policy=config.image_pull_policy,
        # torchrun takes nnodes, nproc-per-node, rendezvous and max-restarts from the PET_* variables
        # that the training-operator sets from elasticPolicy and nprocPerNode.
        # `kiln torchrun`: torchrun, exiting 128+signal when the pod is stopped, so the ExitCode policy retries.
        command=["kiln", "torchrun", "--no-python", "kiln", "train", "--config", SPEC_PATH,
                 "--output", f"{config.scratch_dir}/run"],
        env=env,
        ports=ports,
        resources=k.V1ResourceRequirements(limits=limits, requests=requests),
        volume_mounts=[
            k.V1VolumeMount(name="spec", mount_path=SPEC_MOUNT, read_only=True),
            k.V1VolumeMount(name="dshm", mount_path="/dev/shm"),  # NCCL and dataloaders need more than 64Mi
            k.V1VolumeMount(name="scratch", mount_path=config.scratch_dir),
            k.V1VolumeMount(name="tmp", mount_path=TMP_DIR),
        ],
        # Pod Security `restricted`: the trainer needs no privilege, no capability and no writable root.
        security_context=k.V1SecurityContext(
            allow_privilege_escalation=False,
            capabilities=k.V1Capabilities(drop=["ALL"]),
            read_only_root_filesystem=True,
        ),
    )
    pod = k.V1PodSpec(
        containers=[container],
        service_account_name=n["trainer"],
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
            k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory", size_limit=memory)),
            k.V1Volume(name="scratch", empty_dir=k.V1EmptyDirVolumeSource()),
            k.V1Volume(name="tmp", empty_dir=k.V1EmptyDirVolumeSource()),
        ],
    )
    template = k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels={**MANAGED_BY, RUN_LABEL: run},
                                                           annotations=topology_annotations(s)), spec=pod)

    scheduling = None
    if s.scheduling.gang or s.scheduling.queue or s.scheduling.priority_class_name:
        scheduling = k.KubeflowOrgV1SchedulingPolicy(
            min_available=s.elastic.min_nodes if s.scheduling.gang else None,
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
                min_replicas=s.elastic.min_nodes,
                max_replicas=s.elastic.max_nodes,
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
    body = ApiClient().sanitize_for_serialization(job)
    labels = {KUEUE_QUEUE_LABEL: s.scheduling.queue} if s.scheduling.queue else {}
    if s.scheduling.priority:
        labels[KUEUE_PRIORITY_LABEL] = s.scheduling.priority
    labels = labels or None
    body["metadata"] = metadata(n["job"], labels)
    return body
