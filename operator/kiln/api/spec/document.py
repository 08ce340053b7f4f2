"""The TrainingSpec document: its spec (every section together, checked by kiln.api.rules) and metadata."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kiln.api.base import ApiModel
from kiln.api.pod import NetworkSpec, PodSettings
from kiln.api.spec.checkpoint import CheckpointSpec
from kiln.api.spec.data import DataSpec
from kiln.api.spec.elastic import ElasticSpec
from kiln.api.spec.limits import API_VERSION, KIND
from kiln.api.spec.model import ModelSpec
from kiln.api.spec.resources import ResourcesSpec
from kiln.api.spec.scheduling import SchedulingSpec
from kiln.api.spec.status import TrainingSpecStatus
from kiln.api.spec.tracking import TrackingSpec
from kiln.api.spec.training import ParallelismSpec, TrainingConfig


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
