"""The TrainingSpec API (`kiln.dev/v1alpha1`): the contract between users, the operator and the trainer.

Field names are camelCase on the wire (YAML, the CRD) and snake_case in Python. Every field's
description is what `kubectl explain trainingspec.spec.<path>` shows, so write it for users.
Cross-field rules live in `kiln.api.rules` and are enforced by pydantic here and by CEL in the CRD.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "kiln.dev"
VERSION = "v1alpha1"
KIND = "TrainingSpec"
PLURAL = "trainingspecs"
API_VERSION = f"{GROUP}/{VERSION}"


class ApiModel(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected, Python names accepted too."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )


class ModelSpec(ApiModel):
    """Which model to train: a named preset, optionally with explicit dimensions overriding it."""

    preset: str | None = Field(
        None, description="Named model size: tiny (CPU tests), small, llama-1b, llama-8b. Explicit fields override it."
    )
    dim: int | None = Field(None, ge=8, description="Hidden size (model width).")
    layers: int | None = Field(None, ge=1, description="Number of transformer blocks.")
    heads: int | None = Field(None, ge=1, description="Attention heads.")
    kv_heads: int | None = Field(None, ge=1, description="Key/value heads for grouped-query attention; divides heads.")
    vocab_size: int | None = Field(None, ge=2, description="Vocabulary size (256 for the built-in byte tokenizer).")
    seq_len: int | None = Field(None, ge=2, description="Tokens per training sequence.")
    ffn_dim: int | None = Field(None, ge=8, description="Hidden size of the SwiGLU MLP; derived from dim when unset.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")


class DataSpec(ApiModel):
    """Where training tokens come from."""

    uri: str = Field(
        "builtin:pydoc",
        description=(
            "'synthetic' (random tokens, for throughput tests), 'builtin:pydoc' (a small English corpus that ships "
            "with Python, byte-tokenized), or a folder of tokenized shards: file:///path/ or s3://bucket/prefix/."
        ),
    )


class TrainingConfig(ApiModel):
    """The optimisation: steps, batch, learning-rate schedule, precision."""

    steps: int = Field(1000, ge=1, description="Optimizer steps to train for.")
    global_batch_size: int = Field(8, ge=1, description="Sequences per optimizer step, summed over all data-parallel ranks.")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per forward/backward on one rank; the rest is gradient accumulation.")
    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr (cosine, linear, wsd).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Learning-rate schedule after warm-up: cosine | linear | constant | wsd (warmup-stable-decay)."
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="For wsd: fraction of steps spent in the final decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value; 0 disables clipping.")
    precision: Literal["bf16", "fp32"] = Field(
        "bf16", description="bf16: bf16 compute with fp32 master weights and reductions; fp32: everything in fp32."
    )
    seed: int = Field(0, description="Seed for initialisation and data order; the same seed gives the same run.")
    log_every: int = Field(1, ge=1, description="Log metrics every this many steps.")


class ParallelismSpec(ApiModel):
    """How the world of processes is split: data parallel size is derived as world / (tensor x pipeline)."""

    tensor: int = Field(1, ge=1, description="Tensor-parallel degree; divides processes per node and the head counts.")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel stages; must not exceed layers.")
    pipeline_microbatches: int | None = Field(
        None, ge=1, description="Microbatches per pipeline step (default: max(2 x pipeline, gradient accumulation))."
    )
    fsdp: bool = Field(True, description="Shard parameters, gradients and optimizer state over data parallel (FSDP2).")
    replicate: int = Field(
        1, ge=1, description="HSDP: replicate over this many groups, shard within each (usually = nodes)."
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

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    key: str | None = None
    operator: str | None = None
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None


class ResourcesSpec(ApiModel):
    """What each node (one PyTorchJob worker pod) gets."""

    nodes: int = Field(1, ge=1, description="Worker pods (one per node) to start with.")
    gpus_per_node: int = Field(0, ge=0, description="nvidia.com/gpu per pod; 0 runs on CPU.")
    processes_per_node: int | None = Field(
        None, ge=1, description="Training processes per pod; defaults to gpusPerNode (1 on CPU)."
    )
    gpu_type: str | None = Field(None, description="GPU product, e.g. nvidia-h200; becomes a node selector.")
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. '32'.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. 512Gi.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra node selector, passed through.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations, passed through.")


class PhasePlanEntry(ApiModel):
    """One phase of the elastic plan: run with `nodes` until `untilStep` (the last entry has none)."""

    until_step: int | None = Field(None, ge=1, description="Last step of this phase; omit on the final phase.")
    nodes: int = Field(..., ge=1, description="Nodes to use during this phase.")


class ElasticSpec(ApiModel):
    """Elastic scaling: the job may run with any node count in [minNodes, maxNodes]."""

    min_nodes: int | None = Field(None, ge=1, description="Fewest nodes to keep training with (default: nodes).")
    max_nodes: int | None = Field(None, ge=1, description="Most nodes to grow to (default: nodes).")
    max_restarts: int = Field(10, ge=0, description="Restarts allowed before the run is marked Failed.")
    plan: list[PhasePlanEntry] = Field(default_factory=list, description="Optional phase plan by training step.")


class CheckpointSpec(ApiModel):
    """Where and how often to checkpoint; any world size can resume from a checkpoint."""

    uri: str | None = Field(
        None, description="s3://bucket/prefix/ or file:///path/. Default for `kiln run`: file://<output>/checkpoints/."
    )
    endpoint: str | None = Field(None, description="S3 endpoint URL, e.g. http://minio.minio.svc:9000.")
    credentials_secret: str | None = Field(
        None, description="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; keys are never inline."
    )
    interval_steps: int | Literal["auto"] = Field(
        100, description="Save every N steps, or 'auto' (Young/Daly from the measured save cost and failure rate)."
    )
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; the newest is never deleted.")
    async_save: bool = Field(True, description="Upload in the background; training blocks only to stage state.")


class SchedulingSpec(ApiModel):
    """Batch scheduling: queues, gang scheduling, priority."""

    queue: str | None = Field(None, description="Kueue LocalQueue / Volcano queue name.")
    gang: bool = Field(True, description="Start all pods together or none (gang scheduling).")
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods.")


class TrainingSpecSpec(ApiModel):
    """The desired training run."""

    image: str | None = Field(None, description="Trainer image; defaults to the operator's configured image.")
    model: ModelSpec = Field(default_factory=lambda: ModelSpec(preset="tiny"), description="The model to train.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation settings.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel layout.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-node resources.")
    elastic: ElasticSpec = Field(default_factory=ElasticSpec, description="Elastic scaling and restarts.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Queues and gang scheduling.")
    suspend: bool = Field(False, description="true: checkpoint, then release every GPU; false again: resume.")


class ObjectMeta(ApiModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    name: str = Field("run", description="Name of the run.")
    namespace: str | None = None


class TrainingSpec(ApiModel):
    """A TrainingSpec document as written in YAML."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    api_version: Literal["kiln.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["TrainingSpec"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TrainingSpecSpec = Field(default_factory=TrainingSpecSpec)
