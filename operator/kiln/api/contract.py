"""The contract between the operator and the trainer pods, as names both sides import (DESIGN.md §4).

The operator's plan (kiln.control.plan) sets the pod environment and mounts the spec; the trainer
(kiln.trainer, through `kiln train`) reads them. The status subresource is written by both, each only
its own fields (JSON merge patches): the operator's conditions come from CONDITION_TYPES. The layout
arithmetic, the other half of the contract, is kiln.api.layout. Tests: tests/unit/test_contract.py.
"""

from __future__ import annotations

# ---- the trainer pod: what the plan sets, what the trainer reads ----

SPEC_MOUNT = "/etc/kiln"  # the ConfigMap `<run>-spec`, read-only
SPEC_FILE = "spec.yaml"  # the resolved spec: `kiln train --config /etc/kiln/spec.yaml`
SPEC_PATH = f"{SPEC_MOUNT}/{SPEC_FILE}"

RUN_NAME = "KILN_RUN_NAME"  # the TrainingSpec whose status rank 0 patches (kiln.trainer.observe.status_report)
NAMESPACE = "KILN_NAMESPACE"  # its namespace (downward API)
METRICS_PORT = "KILN_METRICS_PORT"  # rank 0 serves Prometheus /metrics on it (kiln.trainer.observe.exporter); unset: none
SHM_DIR = "KILN_SHM_DIR"  # each rank keeps a copy of the newest commit here (kiln.trainer.checkpoint.host_copy); unset: none
DATA_CACHE = "KILN_DATA_CACHE"  # where downloaded data shards are cached (kiln.trainer.data.loader)
DATA_CACHE_BYTES = "KILN_DATA_CACHE_BYTES"  # the pod's ephemeral-storage limit: data that cannot fit is refused
NODE_NAME = "KILN_NODE_NAME"  # the pod's node (downward API spec.nodeName): names the GPUs in status.gpuHealth

# elastic.faultTolerance replicaGroups (kiln.trainer.membership.replica_groups): the torchft lighthouse, and which group this job is
FT_LIGHTHOUSE = "KILN_FT_LIGHTHOUSE"  # e.g. http://<run>-lighthouse:29510
FT_GROUP = "KILN_FT_GROUP"  # 0 .. groups-1
# the run's secret (hex) that the lighthouse's tunnel asks every group to prove (kiln.trainer.membership.auth):
# in the variable (`kiln run`), or in a file (the operator's pods: its per-run Secret `<run>-ft`, mounted; read
# at each handshake, so a re-created Secret reaches running pods with the kubelet's next sync)
FT_SECRET = "KILN_FT_SECRET"
FT_SECRET_FILE = "KILN_FT_SECRET_FILE"
FT_SECRET_MOUNT = "/etc/kiln-ft"  # the Secret's volume (not under SPEC_MOUNT: no mount inside a ConfigMap's)
FT_SECRET_KEY = "secret"  # its one key: 32 random bytes, hex
# how often the lighthouse looks for a quorum it can form (torchft's default 100 ms): a group that died is
# dropped at the first look after its heartbeat lapses, so each kill waited half a tick more on average
FT_QUORUM_TICK_MS = 20
FT_POD_ENV = (FT_LIGHTHOUSE, FT_GROUP, FT_SECRET_FILE)  # set in a group's pods only (kiln.control.plan), read by kiln.trainer.membership.replica_groups

# GPU pods: PyTorch's NCCL flight recorder keeps the last this-many collectives of each process group, which the
# hang report dumps beside the stacks (kiln.trainer.observe.hang_report). A default, not kiln's own: pod.env may
# set another size (0 turns the recorder off).
GPU_POD_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}

# Tracking credentials, each read by reference from spec.tracking.*.credentialsSecret (optional keys: a Secret may
# hold a token or a user and password).
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
WANDB_SECRET_KEYS = ("WANDB_API_KEY",)
# What kiln's plan sets in the trainer container and a spec's pod.env may not replace (refused by name):
# torchrun and the training-operator's rendezvous, the writable folders of a read-only root, the store's keys.
# Names: every KILN_*, PET_* (the training-operator's, read by torchrun) and TORCHELASTIC_* (torchrun's own).
# The store's and the trackers' keys come from checkpoint.credentialsSecret and tracking.*.credentialsSecret.
RESERVED_ENV_PREFIXES = ("KILN_", "PET_", "TORCHELASTIC_")
RESERVED_ENV = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "TMPDIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME", "TRITON_CACHE_DIR",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
    *MLFLOW_SECRET_KEYS, *WANDB_SECRET_KEYS,  # spec.tracking.*.credentialsSecret's
)
# The trainer pod's own volumes and mount paths (kiln.control.plan); a spec's pod.volumes may use neither.
# /var/lib/kiln is the operator's default scratch folder (OperatorConfig.scratch_dir).
POD_VOLUMES = ("spec", "dshm", "scratch", "tmp", "kiln-ft")
POD_MOUNTS = (SPEC_MOUNT, "/dev/shm", "/tmp", "/var/lib/kiln", FT_SECRET_MOUNT)

# Every KILN_* variable the plan may set; each has a reader in kiln.trainer (a test holds both to it).
POD_ENV = (RUN_NAME, NAMESPACE, METRICS_PORT, SHM_DIR, DATA_CACHE, DATA_CACHE_BYTES, NODE_NAME)

# ---- the status subresource: who writes which field ----

OPERATOR_STATUS = frozenset({"phase", "nodes", "conditions", "observedGeneration", "restarts", "goodput",
                             "goodputDetail", "cost", "scaling", "queue", "replicaGroups"})
TRAINER_STATUS = frozenset({"quorum", "step", "progress", "etaSeconds", "tokensPerSecond", "mfu", "lastCheckpoint",
                            "trainerTime", "gpuHealth", "hang", "preflight", "stragglers", "tracking"})

# The metav1.Condition types the operator sets (kiln.control.status.set_condition refuses any other).
CONDITION_TYPES = ("SpecAccepted", "Queued", "PodsScheduled", "PodsReady", "Running", "Suspended", "Succeeded",
                   "Failed", "Elastic", "GPUHealthy", "Gang")

# ---- GPU health: what trainer rank 0 reports per node in status.gpuHealth (kiln.trainer.observe.gpu_health), and the
# operator acts on (kiln.control.failover) ----

GPU_HEALTHY, GPU_DEGRADING, GPU_FAILING, GPU_UNKNOWN, GPU_NOT_APPLICABLE = GPU_HEALTH_STATES = (
    "Healthy", "Degrading", "Failing", "Unknown", "NotApplicable")
# A GPU node whose health cannot be read is Unknown, never Healthy; a node the run uses no GPU on (CPU) is
# NotApplicable and has no gauge. The Prometheus gauge kiln_gpu_health{node,gpu} (alert rules read it):
GPU_HEALTH_GAUGE = {GPU_HEALTHY: 0, GPU_DEGRADING: 1, GPU_FAILING: 2, GPU_UNKNOWN: -1}
# States that move a run off the node at its next commit (the operator requests that commit).
GPU_MOVE_STATES = (GPU_DEGRADING, GPU_FAILING)
