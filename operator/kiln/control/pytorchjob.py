"""A run's PyTorchJob and what its pods need beside it (their ServiceAccount and Role, their NetworkPolicy),
built with the kubeflow-training and kubernetes models. Pure.

The pod template is the long part and has one shape: what differs between one elastic job and one job per
replica group is a `Shape` that the run's layout part decides (kiln.control.parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.api import contract
from kiln.api.contract import SPEC_MOUNT, SPEC_PATH
from kiln.api.spec import TrainingSpec, TrainingSpecSpec
from kiln.control import pods
from kiln.control.config import OperatorConfig
from kiln.control.elastic import with_avoided_nodes
from kiln.control.k8s import K8S_MODELS, SERIALIZER
from kiln.control.kueue import LEFT_OUT_ANNOTATION
from kiln.control.names import MANAGED_BY, RUN_LABEL, names
from kiln.control.observed import Observed
from kiln.control.requests import GPU, pod_resources, quantity_bytes, queue_fit

k, _SERIALIZER = K8S_MODELS, SERIALIZER  # the kubeflow-training / kubernetes models, one shared Configuration

CONTAINER = "pytorch"  # the training-operator finds the container by this name
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_TOPOLOGY_ANNOTATION = {"required": "kueue.x-k8s.io/podset-required-topology",
                             "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass: Kueue's order and preemption
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


@dataclass(frozen=True)
class Shape:
    """What a run's layout part decides of one of its PyTorchJobs."""
    replicas: int  # Worker pods (one per node) to start with
    min_replicas: int  # elasticPolicy's bounds (equal to replicas: a fixed size)
    max_replicas: int
    env: tuple[tuple[str, str], ...] = ()  # set in its pods after kiln's own
    labels: dict[str, str] = field(default_factory=dict)  # on the job and its pods
    volumes: tuple = ()  # (V1Volume, V1VolumeMount) pairs mounted before the user's (replica groups: the run's secret)

def topology_annotations(s: TrainingSpecSpec) -> dict[str, str] | None:
    """Kueue's pod-set topology request on the worker template (None: no scheduling.topology)."""
    t = s.scheduling.topology
    return {KUEUE_TOPOLOGY_ANNOTATION[t.mode]: t.level} if t else None


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
               shape: Shape) -> dict:
    """The PyTorchJob `name` for a resolved spec, built with the kubeflow-training models, in the shape the
    run's layout part decides (kiln.control.parts: its workers, and what its pods carry besides)."""
    s: TrainingSpecSpec = doc.spec
    r, run = s.resources, doc.metadata.name
    n = names(run)
    replicas, low, high = shape.replicas, shape.min_replicas, shape.max_replicas
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
    env += [k.V1EnvVar(name=key, value=value) for key, value in shape.env]  # the layout part's (replica groups)
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
    user_volumes = [*(v for v, _ in shape.volumes), *user_volumes]
    user_mounts = [*(m for _, m in shape.volumes), *user_mounts]

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
    extra_labels = dict(shape.labels)
    template = k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels={**MANAGED_BY, RUN_LABEL: run, **extra_labels},
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
    labels = {**labels, **extra_labels} or None
    body["metadata"] = metadata(name, labels)
    if left_out:
        body["metadata"]["annotations"] = {LEFT_OUT_ANNOTATION: ",".join(left_out)}
    return body


def tracking_env(tracking) -> list:
    """The trackers' credentials by reference (optional keys), never their values."""
    if tracking is None:
        return []
    wanted = [(t.credentials_secret, keys) for t, keys in ((tracking.mlflow, contract.MLFLOW_SECRET_KEYS),
                                                           (tracking.wandb, contract.WANDB_SECRET_KEYS))
              if t is not None and t.credentials_secret]
    return [k.V1EnvVar(name=key, value_from=k.V1EnvVarSource(secret_key_ref=k.V1SecretKeySelector(
        name=secret, key=key, optional=True))) for secret, keys in wanted for key in keys]
