"""spec.elastic: node-count range, phase plan, restarts and per-step fault tolerance (replica groups)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.base import ApiModel
from kiln.api.spec.limits import INT32_MAX, JSON_INT_MAX, MAX_REPLICA_GROUPS


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
