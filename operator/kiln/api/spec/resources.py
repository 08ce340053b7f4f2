"""spec.resources: what each node gets, and the per-rank checks (pre-flight, stragglers)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.api.base import QUANTITY, ApiModel
from kiln.api.spec.limits import INT32_MAX, JSON_INT_MAX, JSON_INT_MIN


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
