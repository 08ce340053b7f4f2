"""spec.scheduling: Kueue queue, gang, priority and topology-aware placement."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kiln.api.base import ApiModel


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
