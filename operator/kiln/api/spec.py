"""The TrainingSpec API (`kiln.dev/v1alpha1`): the contract between users, the operator and the trainer.

Field names are camelCase on the wire (YAML, the CRD) and snake_case in Python. Every field's
description is what `kubectl explain trainingspec.spec.<path>` shows, so write it for users.
Cross-field rules live in `kiln.api.rules` and are enforced by pydantic here and by CEL in the CRD.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kiln.api.base import QUANTITY, ApiModel
from kiln.api.contract import CONDITION_TYPES
from kiln.api.pod import NetworkSpec, PodSettings
from kiln.api.presets import PRESETS

GROUP = "kiln.dev"
VERSION = "v1alpha1"
KIND = "TrainingSpec"
PLURAL = "trainingspecs"
API_VERSION = f"{GROUP}/{VERSION}"

# Integers as Kubernetes can hold them: replica-like counts are int32 in the objects kiln makes (PyTorchJob
# replicas, min/maxReplicas, backoffLimit; the parallel degrees multiply them in the CEL rules); the rest are
# bounded by ±(2^53 - 1), the largest integers a JSON number carries exactly: the apiserver refuses a CRD
# whose bound lies beyond (it validates bounds as JSON integers), so int64's own limits cannot be written.
# Every integer field carries one of these as its `le`, so the CRD has the same `maximum` and the apiserver
# refuses what `kiln validate` refuses (a test walks the CRD for an integer without one).
INT32_MAX = 2**31 - 1
JSON_INT_MAX = 2**53 - 1
DEFAULT_DATA_URI = "builtin:pydoc"  # also what data.sources requires data.uri to be left at
JSON_INT_MIN = -JSON_INT_MAX
# elastic.faultTolerance.groups: each group is a PyTorchJob the operator renders and applies on every resync, and
# a status entry; one small spec must not fan out into more work than the operator can redo (status lists stop here)
MAX_REPLICA_GROUPS = 4096


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the names in kiln.api.presets, one source


# LoRA's target modules, by their transformers / peft names (q_proj, ...; what `target_modules` says in a peft
# adapter_config.json): the attention and MLP projections every block has.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoraTarget = Literal[LORA_TARGETS]  # type: ignore[valid-type]


class AdapterSpec(ApiModel):
    """Train low-rank adapters instead of every weight (LoRA, Hu et al. 2021): each target projection W gets
    y = W x + (alpha / rank) · B A x with A (rank × in) and B (out × rank) trained and W frozen. Checkpoints hold
    the adapters and their optimizer state only (plus the base model's identity); `kiln export --format peft`
    writes them as a peft adapter folder, `--format hf --merge` the merged model."""

    type: Literal["lora"] = Field("lora", description="The adapter kind: lora.")
    rank: int = Field(16, ge=1, le=INT32_MAX, description="Rank r of each adapter: A is r × in, B is out × r.")
    alpha: float = Field(32.0, gt=0, le=1e6, description="Scale numerator: the update B A is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (0: none).")
    targets: list[LoraTarget] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1, max_length=len(LORA_TARGETS),
        description="The projections of every block that get an adapter, by their transformers names: q_proj, "
        "k_proj, v_proj, o_proj (attention), gate_proj, up_proj, down_proj (MLP). Default: all seven.",
    )


class ModelSpec(ApiModel):
    """Which model to train: a named preset, optionally with explicit dimensions overriding it, or a model
    folder in Hugging Face layout (model.from) whose weights training starts from."""

    preset: PresetName | None = Field(
        None,
        description="Named model size: tiny (CPU tests), small, llama-1b, llama-8b. Explicit fields override it; "
        "without a preset or from, set all of dim, layers, heads, vocabSize, seqLen.",
    )
    from_: str | None = Field(
        None, alias="from", max_length=1024,
        description="A Llama-family model folder in Hugging Face layout to start from (config.json, model.safetensors "
        "or sharded with model.safetensors.index.json, tokenizer files): file:///path/ or s3://bucket/prefix/. Its "
        "config.json sets the dimensions (explicit fields must agree with it; seqLen is free up to "
        "max_position_embeddings, default min(2048, it)). A resumed run loads its own checkpoints, not this.",
    )
    dim: int | None = Field(None, ge=8, le=JSON_INT_MAX, description="Hidden size (model width).")
    layers: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Number of transformer blocks.")
    heads: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Attention heads.")
    kv_heads: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Key/value heads for grouped-query attention; divides heads.")
    vocab_size: int | None = Field(None, ge=2, le=JSON_INT_MAX, description="Vocabulary size (256 for the built-in byte tokenizer).")
    seq_len: int | None = Field(None, ge=2, le=JSON_INT_MAX, description="Tokens per training sequence.")
    ffn_dim: int | None = Field(None, ge=8, le=JSON_INT_MAX, description="Hidden size of the SwiGLU MLP; derived from dim when unset.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    adapter: AdapterSpec | None = Field(
        None, description="Fine-tune with LoRA adapters: the model's own weights (model.from's, else the seed's) "
        "stay frozen, in training.precision; only the adapters and their optimizer state are trained and saved.",
    )


class DataSource(ApiModel):
    """One dataset of a mix (data.sources)."""

    uri: str = Field(
        ..., max_length=1024,
        description="Like data.uri: 'synthetic', 'builtin:pydoc', or a folder of token shards (file:///path/ or "
        "s3://bucket/prefix/, e.g. the output of `kiln data prepare`).",
    )
    weight: float = Field(
        ..., gt=0, le=1e6,
        description="Relative share of this source in every global batch stream: weights 3 and 1 draw 75 % and "
        "25 % of the samples. Only the ratios matter; each share must be at least 1/1000 of the total.",
    )


class DataSpec(ApiModel):
    """Where training tokens come from."""

    uri: str = Field(
        DEFAULT_DATA_URI, max_length=1024,
        description=(
            "'synthetic' (random tokens, for throughput tests), 'builtin:pydoc' (a small English corpus that ships "
            "with Python, tokenized with data.tokenizer: bytes by default), or a folder of tokenized shards: "
            "file:///path/ or s3://bucket/prefix/."
        ),
    )
    tokenizer: str | None = Field(
        None, max_length=1024,
        description="'byte' (the built-in byte tokenizer, vocabulary 256), a tokenizer.json or a model folder holding "
        "one: file://... or s3://.... Default: the model folder's tokenizer when model.from is set, else 'byte'. "
        "builtin:pydoc is tokenized with it; token shards must have been made with it. Its vocabulary must fit "
        "model.vocabSize.",
    )
    sources: list[DataSource] = Field(
        default_factory=list, max_length=16,
        description="Train on a mix of datasets in fixed proportions instead of data.uri (leave data.uri unset). "
        "The mix is deterministic and resumes at any world size; the realised shares are reported per source "
        "(metrics.jsonl data_mix, Prometheus kiln_data_source_share). All sources use data.tokenizer.",
    )
    format: Literal["text", "chat"] = Field(
        "text",
        description="text: the loss is taken on every token. chat: on the assistant's tokens only, averaged over "
        "the whole global batch; data.uri (or every data.sources uri) is a folder of conversations prepared with "
        "`kiln data prepare --format chat`, which renders them with the tokenizer's chat template and writes "
        "each shard's assistant mask. Needs data.tokenizer (or model.from) with a chat template.",
    )
    packing: bool = Field(
        False,
        description="Pack whole documents (chat: whole conversations), several to a sequence of model.seqLen, "
        "instead of cutting the token stream into windows: attention never crosses a document and positions "
        "restart at each one, so each token's loss is the one it has alone; padding carries no loss. Text "
        "documents longer than a sequence are cut into pieces; a conversation longer than model.seqLen + 1 tokens "
        "is refused. Needs a folder prepared by `kiln data prepare` (file:// or s3://), which records where "
        "documents start. Rows are planned best-fit decreasing and visited in the seeded order (docs/models.md).",
    )


class TrainingConfig(ApiModel):
    """The optimisation: steps, batch, learning-rate schedule, precision."""

    steps: int = Field(1000, ge=1, le=JSON_INT_MAX, description="Optimizer steps to train for.")
    global_batch_size: int = Field(8, ge=1, le=JSON_INT_MAX, description="Sequences per optimizer step, summed over all data-parallel ranks.")
    micro_batch_size: int = Field(1, ge=1, le=JSON_INT_MAX, description="Sequences per forward/backward on one rank; the rest is gradient accumulation.")
    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr (cosine, linear, wsd).")
    warmup_steps: int = Field(0, ge=0, le=JSON_INT_MAX, description="Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Learning-rate schedule after warm-up: cosine | linear | constant | wsd (warmup-stable-decay)."
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="For wsd: fraction of steps spent in the final decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value; 0 disables clipping.")
    precision: Literal["bf16", "fp32"] = Field(
        "bf16", description="bf16: bf16 compute with fp32 master weights and reductions; fp32: everything in fp32."
    )
    seed: int = Field(0, ge=JSON_INT_MIN, le=JSON_INT_MAX, description="Seed for initialisation and data order; the same seed gives the same run.")
    log_every: int = Field(1, ge=1, le=JSON_INT_MAX, description="Log metrics every this many steps.")


class ParallelismSpec(ApiModel):
    """How the world of processes is split: data parallel size is derived as world / (tensor x pipeline)."""

    tensor: int = Field(1, ge=1, le=INT32_MAX, description="Tensor-parallel degree; divides processes per node and the head counts.")
    pipeline: int = Field(1, ge=1, le=INT32_MAX, description="Pipeline-parallel stages; must not exceed layers.")
    pipeline_microbatches: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Microbatches per pipeline step: at least pipeline, dividing each data-parallel "
        "rank's sequences (default: the fewest >= max(2 x pipeline, gradient accumulation) that divide them)."
    )
    fsdp: bool = Field(True, description="Shard parameters, gradients and optimizer state over data parallel (FSDP2).")
    replicate: int = Field(
        1, ge=1, le=INT32_MAX, description="HSDP: replicate over this many groups, shard within each (usually = nodes)."
    )
    compile: bool = Field(True, description="torch.compile each transformer block.")
    activation_checkpoint: Literal["none", "selective", "full"] = Field(
        "none", description="Recompute activations in backward to save memory: none | selective | full."
    )
    kernels: Literal["fused", "reference"] = Field(
        "fused", description="fused: Triton kernels on GPU (torch.compile elsewhere); reference: plain PyTorch ops."
    )
    gradient_compression: Literal["none", "bf16", "powersgd"] = Field(
        "none", description="Compress gradients on the replicated data-parallel dimension: none | bf16 | powersgd."
    )


class Toleration(ApiModel):
    """A Kubernetes toleration, passed through to the pods."""

    key: str | None = Field(None, description="Taint key the toleration applies to; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default Equal).")
    value: str | None = Field(None, description="Taint value to match with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(None, ge=JSON_INT_MIN, le=JSON_INT_MAX, description="For NoExecute: how long the pod stays bound after the taint.")


class PreflightSpec(ApiModel):
    """A check of every rank before step 1 (kiln.trainer.observe.preflight, docs/preflight.md)."""

    enabled: bool = Field(True, description="Run the check before the first step of every (re)start; false starts "
                          "training at once.")
    min_relative_speed: float = Field(
        0.8, gt=0, le=1,
        description="A rank whose matmul rate is below this fraction of the ranks' median is named, with its node, "
        "in status.preflight.",
    )


class StragglerSpec(ApiModel):
    """Per-rank step time, own work against waiting, gathered to rank 0 (kiln.trainer.observe.stragglers)."""

    enabled: bool = Field(True, description="Gather each rank's step-time split every everySteps steps.")
    every_steps: int = Field(10, ge=1, le=1_000_000, description="Steps averaged per report (one small collective).")
    factor: float = Field(
        1.5, gt=1, le=100,
        description="A rank whose own time (data and compute, not waiting in collectives) is above factor x the "
        "ranks' median is slow in that report.",
    )
    window: int = Field(3, ge=1, le=1000, description="Consecutive slow reports before a rank is named a straggler "
                        "in status.stragglers.")


class ResourcesSpec(ApiModel):
    """What each node (one PyTorchJob worker pod) gets."""

    nodes: int = Field(1, ge=1, le=INT32_MAX, description="Worker pods (one per node) to start with; the scale subresource sets it.")
    gpus_per_node: int = Field(0, ge=0, le=64, description="nvidia.com/gpu per pod; 0 runs on CPU.")
    processes_per_node: int | None = Field(
        None, ge=1, le=256, description="Training processes per pod; defaults to gpusPerNode (1 on CPU)."
    )
    gpu_type: str | None = Field(
        None, max_length=128,
        description="GPU product as the nodes' nvidia.com/gpu.product label spells it (case-sensitive), e.g. "
                    "NVIDIA-H200; becomes that node selector.",
    )
    gpu_health_interval_seconds: float = Field(
        60.0, ge=0, le=86400,
        description="Seconds between GPU health probes (NVML, each node's first process), counted on a clock, not "
        "in steps: a probe comes at the end of the first step after the interval, at the first step too; 0 turns "
        "them off.",
    )
    cpu: str | None = Field(None, max_length=32, pattern=QUANTITY, description="CPU request and limit per pod, e.g. '32'.")
    memory: str | None = Field(None, max_length=32, pattern=QUANTITY,
                               description="Memory request and limit per pod, e.g. 512Gi.")
    ephemeral_storage: str | None = Field(
        None, max_length=32, pattern=QUANTITY,
        description="Local disk per pod, request and limit (the downloaded data shards, compile caches, scratch), "
        "e.g. 500Gi. Default: the operator's (KILN_DEFAULT_EPHEMERAL_STORAGE, 50Gi). A data.uri whose shards do "
        "not fit is refused at start, before anything is downloaded.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra node selector, passed through.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Tolerations, passed through to every pod."
    )
    affinity: dict[str, Any] | None = Field(
        None, description="A core/v1 Affinity, passed through to every pod unchanged (not validated by kiln)."
    )
    preflight: PreflightSpec = Field(default_factory=PreflightSpec, description="The check of every rank before "
                                     "step 1: a matmul rate and the world's collective bandwidth.")
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec, description="Naming a rank slower than the "
                                      "others, step after step.")


class PhasePlanEntry(ApiModel):
    """One phase of the elastic plan: run with `nodes` until `untilStep` (the last entry has none)."""

    until_step: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Last step of this phase; omit on the final phase.")
    nodes: int = Field(..., ge=1, le=INT32_MAX, description="Nodes to use during this phase; within [minNodes, maxNodes].")


class FaultToleranceSpec(ApiModel):
    """Per-step fault tolerance across replica groups (torchft): the healthy groups keep stepping while a
    failed one restarts and heals from a live peer (docs/resilience.md "Replica groups")."""

    mode: Literal["off", "replicaGroups"] = Field(
        "off",
        description="off: a fault restarts the whole job from the last commit (as without this field). "
        "replicaGroups: the data-parallel dimension is split into `groups` replica groups, each its own "
        "torchrun job (FSDP/TP/PP inside it as usual); gradients are averaged across the live groups every step "
        "through torchft's fault-tolerant process group, a group that fails restarts alone and copies weights "
        "and optimizer state from a live peer, not from the checkpoint.",
    )
    groups: int = Field(
        2, ge=1, le=MAX_REPLICA_GROUPS,
        description="Replica groups; must divide the data-parallel size (world / (tensor × pipeline)). Each "
        "group reads globalBatchSize / groups sequences per step; at most 4096 (the admin may cap it lower).",
    )


class ElasticSpec(ApiModel):
    """Elastic scaling: the job may run with any node count in [minNodes, maxNodes]."""

    min_nodes: int | None = Field(None, ge=1, le=INT32_MAX, description="Fewest nodes to keep training with (default: nodes).")
    max_nodes: int | None = Field(None, ge=1, le=INT32_MAX, description="Most nodes to grow to (default: nodes).")
    max_restarts: int = Field(10, ge=0, le=INT32_MAX, description="Restarts allowed before the run is marked Failed.")
    plan: list[PhasePlanEntry] = Field(
        default_factory=list, max_length=16,
        description="Optional phase plan by training step, in order: every entry but the last has untilStep.",
    )
    fault_tolerance: FaultToleranceSpec | None = Field(
        None, description="Per-step fault tolerance across replica groups (torchft); unset or mode off: none.",
    )


class CheckpointSpec(ApiModel):
    """Where and how often to checkpoint; any world size can resume from a checkpoint."""

    uri: str | None = Field(
        None, max_length=1024,
        description="s3://bucket/prefix/ or file:///path/. Default for `kiln run`: file://<output>/checkpoints/; "
        "an s3:// uri without endpoint is AWS S3, and without credentialsSecret uses the pods' own AWS identity.",
    )
    endpoint: str | None = Field(
        None, max_length=1024,
        description="S3 endpoint URL, e.g. http://minio.minio.svc:9000; unset: AWS S3 (https://s3.amazonaws.com).",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Name of a Secret in the run's namespace with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
        "the pods read it by reference, keys are never inline. Unset: the pods' own AWS identity (EKS Pod "
        "Identity on the run's ServiceAccount <name>-trainer, ECS, the node's instance role).",
    )
    interval_steps: Annotated[int, Field(le=JSON_INT_MAX)] | Literal["auto"] = Field(
        100,
        description="Save every N steps (N >= 1), or 'auto' (Young/Daly from the measured save cost and failure rate).",
    )
    keep: int = Field(3, ge=1, le=JSON_INT_MAX, description="Committed checkpoints to keep; the newest is never deleted.")
    async_save: bool = Field(True, description="Upload in the background; training blocks only to stage state.")


# A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters
# (alphanumerics, '-', '_', '.'; alphanumeric at both ends). The prefix's 253-character bound is checked below.
LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_PREFIX_MAX = 253


class TopologySpec(ApiModel):
    """Topology-aware placement by Kueue: the pods in one domain (rack, block) of the node topology."""

    level: str = Field(
        ..., min_length=1, max_length=LABEL_PREFIX_MAX + 1 + 63, pattern=LABEL_KEY,
        description="Node label key of a level of the Kueue Topology behind the run's queue (e.g. a rack "
        "label such as cloud.provider.com/topology-rack); the run's pods are placed within one domain of it.",
    )
    mode: Literal["required", "preferred"] = Field(
        "required",
        description="required: all pods in one domain of the level, or the run waits Queued with Kueue's reason "
        "(annotation kueue.x-k8s.io/podset-required-topology). preferred: as few domains as Kueue finds room in, "
        "trying the level first, then the levels above (kueue.x-k8s.io/podset-preferred-topology).",
    )

    @field_validator("level")
    @classmethod
    def _prefix_length(cls, v: str) -> str:
        prefix, _, _ = v.rpartition("/")
        if len(prefix) > LABEL_PREFIX_MAX:
            raise ValueError(f"the prefix of a label key is at most {LABEL_PREFIX_MAX} characters, "
                             f"got {len(prefix)}")
        return v


class SchedulingSpec(ApiModel):
    """Batch scheduling: queues, gang scheduling, priority, topology-aware placement."""

    queue: str | None = Field(
        None, max_length=63,
        description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name) and PyTorchJob schedulingPolicy.queue.",
    )
    gang: bool = Field(
        True, description="Sets the PyTorchJob's schedulingPolicy.minAvailable = elastic.minNodes (default: nodes), "
                          "the fewest pods the run trains with. Only a gang scheduler (Volcano, scheduler-plugins "
                          "coscheduling) reads it; kiln's pods go to the default kube-scheduler, which places them "
                          "one by one. All or nothing holds through Kueue admission when queue is set (condition "
                          "Gang says which holds for the run)."
    )
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the pods.")
    priority: str | None = Field(
        None, max_length=63,
        description="Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class): the run's place in its queue "
        "and which runs it may preempt. Separate from priorityClassName, the pods' PriorityClass.",
    )
    topology: TopologySpec | None = Field(
        None, description="Topology-aware placement by Kueue (needs queue, whose ClusterQueue's flavor names a "
        "Kueue Topology with this level).",
    )


class MlflowTracking(ApiModel):
    """An MLflow tracking server that trainer rank 0 logs the run to."""

    uri: str = Field(
        ..., min_length=1, max_length=1024, pattern=r"^(https?|file)://",
        description="Tracking server URI, e.g. http://mlflow.mlflow.svc:5000 (file:// for a local folder with "
        "kiln run).",
    )
    experiment: str | None = Field(
        None, min_length=1, max_length=256,
        description="Experiment name (created if missing). Default: <namespace>/<name> of the TrainingSpec.",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Secret in the run's namespace with MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (each optional); read by reference, never inline.",
    )


class WandbTracking(ApiModel):
    """A Weights & Biases project that trainer rank 0 logs the run to."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, max_length=128, description="W&B entity (team or user); default: the key's.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: send as it trains; offline: write the run's folder (under the output "
        "directory) for a later `wandb sync`.",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Secret in the run's namespace with WANDB_API_KEY; read by reference, never inline.",
    )


class TrackingSpec(ApiModel):
    """Experiment tracking: parameters once, every logged step's metrics, checkpoint commits. A restarted run
    continues the same tracked run; a tracker that is down or slow never blocks or fails a step."""

    mlflow: MlflowTracking | None = Field(None, description="Log to an MLflow tracking server.")
    wandb: WandbTracking | None = Field(None, description="Log to Weights & Biases.")
    buffer: int = Field(
        10_000, ge=1, le=1_000_000,
        description="Records held while a tracker is slow or down; beyond it a record is dropped and counted "
        "(tracking_dropped in metrics.jsonl).",
    )


class TrainingSpecSpec(ApiModel):
    """The desired training run."""

    image: str | None = Field(
        None, max_length=512, description="Trainer image; defaults to the operator's configured image."
    )
    model: ModelSpec = Field(default_factory=lambda: ModelSpec(preset="tiny"), description="The model to train.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation settings.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel layout.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-node resources.")
    elastic: ElasticSpec = Field(default_factory=ElasticSpec, description="Elastic scaling and restarts.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Queues and gang scheduling.")
    tracking: TrackingSpec | None = Field(None, description="Experiment tracking in MLflow and/or W&B.")
    pod: PodSettings = Field(
        default_factory=PodSettings, description="Settings of the trainer pods a site needs (environment, volumes, "
        "/dev/shm, pull secrets, service account, extra devices, runtime class, capabilities, host namespaces), "
        "under the operator's admin policy (docs/pods.md).")
    network: NetworkSpec | None = Field(
        None, description="The fabric between the nodes: NCCL's environment and the device requests a fabric "
        "needs (docs/pods.md \"Network presets\"). Unset: NCCL's own choice.")
    suspend: bool = Field(False, description="true: checkpoint, then release every GPU; false again: resume.")

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> "TrainingSpecSpec":
        # The rules live in kiln.api.rules (they also generate the CRD's CEL); imported here to avoid a cycle.
        # Validation context {"rules": "all"} adds the rules that only hold on Kubernetes (kiln validate).
        from kiln.api.rules import check

        problems = check(self, scope=(info.context or {}).get("rules", "local"))
        if problems:
            raise ValueError("\n".join(problems))
        return self


# ---- status: written by the operator (phase, conditions, nodes, restarts, goodput) and trainer rank 0 (step, metrics) ----

Phase = Literal["Pending", "Queued", "Running", "Scaling", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


class Condition(ApiModel):
    """A standard metav1.Condition."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    type: str = Field(..., max_length=316, description="Condition type, e.g. SpecAccepted, Running, Suspended.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(..., max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field("", max_length=32768, description="Human-readable details.")
    last_transition_time: str = Field(..., description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The spec generation this condition is about.")


class CheckpointRef(ApiModel):
    """The newest committed checkpoint."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="Training step the checkpoint holds.")
    uri: str = Field(..., description="Folder of the checkpoint, e.g. s3://bucket/run/step-00001000/.")
    time: str | None = Field(None, description="When it was committed (RFC 3339).")


class TrainerTime(ApiModel):
    """Cumulative seconds trainer rank 0 counted since the run started (carried in the checkpoint)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    productive_seconds: float = Field(0.0, ge=0, description="Completed, accepted optimizer steps.")
    checkpoint_stall_seconds: float = Field(0.0, ge=0, description="Training blocked on checkpoint staging/saving.")
    rollback_seconds: float = Field(0.0, ge=0, description="Steps undone or redone after a guard rollback.")
    degraded_seconds: float = Field(
        0.0, ge=0, description="Replica groups: of productiveSeconds, the steps taken with fewer than all groups live."
    )
    preflight_seconds: float = Field(0.0, ge=0, description="The pre-flight checks before step 1 of each start.")


GpuHealthState = Literal["Healthy", "Degrading", "Failing", "Unknown", "NotApplicable"]  # contract.GPU_HEALTH_STATES


class GpuState(ApiModel):
    """One GPU's health as NVML shows it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    index: int = Field(..., ge=0, le=INT32_MAX, description="NVML device index on the node.")
    state: GpuHealthState = Field(..., description="Healthy | Degrading | Failing | Unknown (NVML not readable).")


class NodeGpuHealth(ApiModel):
    """The GPUs of one node the run uses, as its trainer last read them through NVML."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    node: str = Field(..., max_length=253, description="The node (the pod's spec.nodeName).")
    state: GpuHealthState = Field(
        ..., description="The worst of its GPUs: Healthy, Degrading (near thermal slowdown, a warning XID, many "
        "corrected ECC errors), Failing (uncorrected ECC, a fatal XID, a pending row remap; the operator moves "
        "the run off the node at its next commit, as for Degrading), Unknown (a GPU node whose NVML cannot be "
        "read; never taken for Healthy) or NotApplicable (the run uses no GPU there).",
    )
    message: str = Field("", max_length=1024, description="Why, naming each GPU that is not Healthy.")
    gpus: list[GpuState] = Field(default_factory=list, max_length=64, description="Each GPU's state.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The training step it was read at.")


class LostSeconds(ApiModel):
    """Wall seconds lost, by cause."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    pending: float = Field(0.0, ge=0, description="Waiting for pods, capacity or a queue (Pending, Queued, Scaling).")
    restart: float = Field(0.0, ge=0, description="Restarting, plus steps redone after resuming from a commit.")
    gpu_failover: float = Field(0.0, ge=0, description="Moving the run off a node whose GPU health is Degrading or "
                                "Failing: from the commit request until the trainer reports from the new nodes.")
    checkpoint_stall: float = Field(0.0, ge=0, description="Training blocked on checkpoints.")
    rollback: float = Field(0.0, ge=0, description="Steps undone or redone after a guard rollback.")
    suspended: float = Field(0.0, ge=0, description="spec.suspend was true.")
    preempted: float = Field(0.0, ge=0, description="Queued after Kueue preempted the run, until it is admitted again.")
    preflight: float = Field(0.0, ge=0, description="The pre-flight check before step 1 of each start "
                             "(trainerTime.preflightSeconds).")


class SlowRank(ApiModel):
    """One rank below the others (pre-flight) or persistently slower than them (stragglers)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    rank: int = Field(..., ge=0, le=INT32_MAX, description="The trainer rank.")
    node: str = Field(..., max_length=253, description="Its node (the pod's spec.nodeName).")
    relative: float = Field(..., ge=0, description="Pre-flight: its matmul rate / the median's; stragglers: its own "
                            "step time / the median's.")
    value: float = Field(..., ge=0, description="Pre-flight: its matmul GFLOP/s; stragglers: its own seconds per step.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Stragglers: the step of the report that named it.")


class PreflightStatus(ApiModel):
    """The last pre-flight check (kiln.trainer.observe.preflight), trainer rank 0."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    checked_at: str = Field(..., max_length=64, description="When it ended (RFC 3339).")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="The step training started from after it.")
    seconds: float = Field(..., ge=0, description="How long it took on rank 0.")
    ranks: int = Field(..., ge=1, le=INT32_MAX, description="Ranks measured.")
    median_gflops: float = Field(..., ge=0, description="The ranks' median matmul GFLOP/s.")
    bandwidth_gbps: float | None = Field(None, ge=0, description="All-reduce bus bandwidth of the job's world "
                                         "group, GB/s (none in a world of one).")
    slow: list[SlowRank] = Field(default_factory=list, max_length=4096, description="Ranks below "
                                 "resources.preflight.minRelativeSpeed x the median.")


class HangStatus(ApiModel):
    """The last hang the trainer caught (kiln.trainer.observe.hang_report): where every rank's stacks are, and the
    ranks the others wait for."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    detected_at: str = Field(..., max_length=64, description="When rank 0 reported it (RFC 3339).")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="The last step rank 0 completed.")
    stacks_uri: str = Field(..., max_length=2048, description="The folder of rank-N.txt stack dumps in the store.")
    ranks_reported: int = Field(..., ge=0, le=INT32_MAX, description="Ranks whose stacks reached the store.")
    waiting_for: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=list, max_length=4096,
        description="Ranks not inside a torch.distributed call while the others wait in one: whom they wait for.")


class GpuHours(ApiModel):
    """GPU-hours (or their price) by cause: what the run's GPUs were held for. The causes add up to the total."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    productive: float = Field(0.0, ge=0, description="Held while stepping (trainerTime.productiveSeconds).")
    pending: float = Field(0.0, ge=0, description="Always 0: a Pending or Queued run's pods hold no GPU.")
    restart: float = Field(0.0, ge=0, description="Held while restarting, plus the steps redone after a resume.")
    checkpoint_stall: float = Field(0.0, ge=0, description="Held while training blocked on checkpoints.")
    rollback: float = Field(0.0, ge=0, description="Held while steps were undone or redone after a guard rollback.")
    suspended: float = Field(0.0, ge=0, description="Always 0: a Suspended run holds no GPU.")
    preempted: float = Field(0.0, ge=0, description="Always 0: a preempted run waits Queued, holding no GPU.")
    gpu_failover: float = Field(0.0, ge=0, description="Held while moving off a node whose GPUs degrade or fail.")
    preflight: float = Field(0.0, ge=0, description="Held while the pre-flight check ran before step 1.")
    other: float = Field(0.0, ge=0, description="Held while running but not stepping: start-up, restore, data waits.")


class CostStatus(ApiModel):
    """What the run's GPUs cost (the operator's view: nodes × gpusPerNode while its pods hold them × time)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    gpu_hours: float = Field(0.0, ge=0, description="GPU-hours the run held since it was created.")
    gpu_hours_by_cause: GpuHours = Field(default_factory=GpuHours, description="gpuHours by cause.")
    price_per_gpu_hour: float | None = Field(
        None, ge=0, description="The platform's price of a GPU-hour of the run's gpuType (operator setting "
        "KILN_GPU_PRICES, chart values cost.pricePerGpuHour); unset: no amount.")
    currency: str | None = Field(None, max_length=16, description="The price's currency (chart values cost.currency).")
    amount: float | None = Field(None, ge=0, description="gpuHours × pricePerGpuHour.")
    amount_by_cause: GpuHours | None = Field(None, description="amount by cause (the same causes as gpuHoursByCause).")


class ScalingPhase(ApiModel):
    """Throughput at one node count the run trained at (kiln.control.scaling)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    nodes: int = Field(..., ge=0, le=INT32_MAX, description="The node count.")
    workers: int = Field(..., ge=0, le=INT32_MAX, description="nodes × processes per node.")
    tokens_per_second_per_worker: float = Field(
        ..., ge=0, description="Moving average (weight 0.2 for the newest) of the trainer's reported tokens/s "
        "divided by workers; the first report at a node count (its start-up) is skipped.")
    reports: int = Field(..., ge=0, le=INT32_MAX, description="Trainer reports averaged.")
    efficiency: float | None = Field(
        None, ge=0, description="tokensPerSecondPerWorker / the reference phase's (referenceNodes): 1.0 is "
        "perfect scaling.")


class ScalingStatus(ApiModel):
    """Scaling efficiency per phase: is the larger world worth its GPUs?"""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    reference_nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="The first node count measured.")
    phases: list[ScalingPhase] = Field(default_factory=list, max_length=64, description="One entry per node count.")
    last_step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The step of the last report folded in.")
    last_nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="The node count of the last report.")


class GoodputDetail(ApiModel):
    """The operator's goodput ledger; the rest of wallSeconds is start-up, restore and data waits."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    observed_at: str = Field(..., description="Time accounted up to (RFC 3339).")
    wall_seconds: float = Field(0.0, ge=0, description="Seconds since the run was created, up to observedAt.")
    productive_seconds: float = Field(0.0, ge=0, description="Productive step seconds credited.")
    degraded_seconds: float = Field(
        0.0, ge=0, description="Replica groups: of productiveSeconds, the seconds the run stepped with fewer than "
        "all groups live (degraded, still training; the time nothing stepped is in lostSeconds)."
    )
    lost_seconds: LostSeconds = Field(default_factory=LostSeconds, description="Lost seconds by cause.")
    gpu_seconds: dict[str, float] = Field(
        default_factory=dict, description="GPU-seconds held by cause (status.cost is this in hours and money)."
    )
    credited: dict[str, float] = Field(
        default_factory=dict, description="The trainerTime counters already accounted (the operator's baseline)."
    )


GROUP_QUEUE_MESSAGE_MAX = 1024  # status.replicaGroups[].queueMessage keeps this much of Kueue's message


class ReplicaGroupStatus(ApiModel):
    """One replica group's PyTorchJob, as the operator sees it (elastic.faultTolerance replicaGroups)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    group: int = Field(..., ge=0, le=INT32_MAX, description="The group's number (KILN_FT_GROUP).")
    job: str | None = Field(None, max_length=253, description="Its PyTorchJob, <run>-g<group>.")
    phase: Literal["Pending", "Running", "Restarting", "Succeeded", "Failed"] = Field(
        ..., description="Running: every pod of the group runs; Restarting: the group lost a pod and restarts "
        "alone while the others train on; Pending: not started (or held by a queue).")
    pods: int = Field(0, ge=0, le=INT32_MAX, description="Its pods running.")
    restarts: int = Field(0, ge=0, le=JSON_INT_MAX, description="Times the group left Running (a restart of it alone).")
    queued: bool | None = Field(
        None, description="scheduling.queue only: true while Kueue holds the group's PyTorchJob (not admitted yet, or "
        "evicted and waiting again); each group's job has a Workload of its own and is admitted alone.")
    queue_reason: str | None = Field(
        None, max_length=1024, description="Why it waits: Kueue's reason (Pending, Preempted, PodsReadyTimeout, ...) "
        "or kiln's own (NoWorkload, WaitingForKueue); Admitted once admitted.")
    queue_message: str | None = Field(
        None, max_length=GROUP_QUEUE_MESSAGE_MAX, description="Kueue's message for the group's Workload (e.g. which "
        f"quota is short), its first {GROUP_QUEUE_MESSAGE_MAX} characters.")
    admitted_at: str | None = Field(None, description="When Kueue last admitted the group (RFC 3339).")


class QuorumStatus(ApiModel):
    """The replica groups' last quorum, as trainer rank 0 of the group at replica rank 0 reports it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    id: int = Field(..., ge=-1, le=JSON_INT_MAX, description="The lighthouse's quorum id (it grows on each change).")
    live_groups: int = Field(..., ge=0, le=INT32_MAX, description="Groups that took part in the last step.")
    groups: int = Field(..., ge=1, le=INT32_MAX, description="elastic.faultTolerance.groups.")
    changes: int = Field(0, ge=0, le=JSON_INT_MAX, description="Quorum changes the reporting trainer has seen.")
    heals: int = Field(0, ge=0, le=JSON_INT_MAX, description="Times the reporting group healed from a live peer.")


TOPOLOGY_DOMAINS_MAX = 256  # status.queue.topology.domains lists at most this many (the first ones)


class QueueTopology(ApiModel):
    """Where Kueue's topology-aware scheduling placed the run."""

    levels: list[str] = Field(default_factory=list, max_length=16,
                              description="The Topology levels (node label keys) the domains are given in.")
    domains: list[str] = Field(
        default_factory=list, max_length=TOPOLOGY_DOMAINS_MAX,
        description="The domains the pods were placed in, each its values at the levels joined by '/' (with "
        f"kubernetes.io/hostname as the only level: the nodes); the first {TOPOLOGY_DOMAINS_MAX}.",
    )


class QueueStatus(ApiModel):
    """Where Kueue has the run (operator-written, only for a run with scheduling.queue)."""

    name: str = Field(..., max_length=63, description="The LocalQueue.")
    admitted_at: str | None = Field(None, description="When Kueue last admitted the run (RFC 3339).")
    cluster_queue: str | None = Field(None, max_length=253, description="The ClusterQueue that admitted it.")
    flavors: list[str] = Field(default_factory=list, max_length=64, description="The ResourceFlavors it was given.")
    topology: QueueTopology | None = Field(
        None, description="The topology domains Kueue placed it in (a flavor with a Kueue Topology only).")
    waiting_groups: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        None, max_length=MAX_REPLICA_GROUPS, description="elastic.faultTolerance replicaGroups: the groups Kueue has not admitted "
        "(each group is admitted alone; the run runs once one is, and admittedAt, clusterQueue and flavors are the "
        "lowest-numbered admitted group's). Empty once every group is admitted.")


class TrainingSpecStatus(ApiModel):
    """What the run is doing: the operator writes phase, conditions, nodes and goodput; trainer rank 0 writes
    progress and trainerTime."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    phase: Phase | None = Field(
        None, description="Pending | Queued | Running | Scaling | Restarting | Suspended | Succeeded | Failed."
    )
    nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="Worker pods currently running.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Last completed optimizer step.")
    progress: str | None = Field(None, description="step / training.steps as a percentage, e.g. '12.3%'.")
    eta_seconds: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Estimated seconds to the last step at the current rate.")
    tokens_per_second: float | None = Field(None, ge=0, description="Training throughput, all ranks together.")
    mfu: float | None = Field(None, ge=0, description="Model FLOPs utilisation (0..1).")
    last_checkpoint: CheckpointRef | None = Field(None, description="The newest committed checkpoint.")
    trainer_time: TrainerTime | None = Field(None, description="Trainer rank 0's cumulative time counters.")
    gpu_health: list[NodeGpuHealth] | None = Field(
        None, max_length=1024, description="Trainer rank 0: each node's GPU health, read through NVML at the "
        "trainer's first step, then every resources.gpuHealthIntervalSeconds (at the end of the step in which "
        "the interval passes).",
    )
    goodput: float | None = Field(
        None, ge=0, le=1, description="Productive step seconds / wall seconds since the run was created (operator)."
    )
    goodput_detail: GoodputDetail | None = Field(None, description="Wall, productive and lost seconds by cause.")
    cost: CostStatus | None = Field(None, description="GPU-hours held by cause, and their price where the platform "
                                    "set one for the run's gpuType.")
    preflight: PreflightStatus | None = Field(None, description="The last pre-flight check: each rank's matmul "
                                              "rate against the median, the world's bandwidth, the slow ranks.")
    stragglers: list[SlowRank] | None = Field(
        None, max_length=4096, description="Ranks whose own step time stayed above resources.stragglers.factor x the "
        "median for resources.stragglers.window reports (trainer); empty when none is.")
    hang: HangStatus | None = Field(None, description="The last hang the trainer caught: its stacks and the "
                                    "rank the others waited for.")
    scaling: ScalingStatus | None = Field(None, description="Tokens/s per worker at each node count, relative to the "
                                          "first (scaling efficiency per phase).")
    restarts: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Times the PyTorchJob entered Restarting.")
    queue: QueueStatus | None = Field(None, description="Kueue: the queue, and when and where it admitted the run.")
    replica_groups: list[ReplicaGroupStatus] | None = Field(
        None, max_length=MAX_REPLICA_GROUPS, description="elastic.faultTolerance replicaGroups: each group's PyTorchJob (operator)."
    )
    quorum: QuorumStatus | None = Field(
        None, description="elastic.faultTolerance replicaGroups: the last quorum of live groups (trainer)."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description=f"metav1.Conditions: {', '.join(CONDITION_TYPES)}."
    )
    observed_generation: int | None = Field(
        None, ge=0, le=JSON_INT_MAX, description="The metadata.generation the operator acted on last."
    )


class ObjectMeta(ApiModel):
    """The parts of metadata kiln reads; the rest is kept as it is."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    name: str = Field("run", description="Name of the run.")
    namespace: str | None = None


class TrainingSpec(ApiModel):
    """A TrainingSpec document as written in YAML (and as stored by the apiserver)."""

    # forbid: a typo of a top-level key (`sepc:`) must not silently run the default spec
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    api_version: Literal["kiln.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["TrainingSpec"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TrainingSpecSpec = Field(default_factory=TrainingSpecSpec)
    status: TrainingSpecStatus | None = Field(None, description="Observed state; written by kiln, never by users.")

    @field_validator("metadata")
    @classmethod
    def _name_rule(cls, meta: ObjectMeta) -> ObjectMeta:
        # a field validator, so a bad name is reported together with any problem in spec
        from kiln.api.rules import check_name

        problems = check_name(meta.name)
        if problems:
            raise ValueError("\n".join(problems))
        return meta
