"""A run's layout as a part: how its training is laid out in PyTorchJobs, and what of that its status shows.

As Kubeflow Trainer's plugins (a small interface each plugin implements, and a registry that picks them), kiln
has one interface, `Layout`, and two parts: `SingleJob` (one elastic PyTorchJob) and
kiln.control.replica_groups.ReplicaGroups (one fixed-size job per group, and torchft's lighthouse). The plan,
the reconcile, the status and the elastic loop ask the run's part (`layout_of`, decided once from the spec)
instead of testing whether the run has groups. A new layout is a new part here and a line in `layout_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from kiln.api.layout import fault_tolerance_groups, replica_groups
from kiln.api.spec import FaultToleranceSpec, TrainingSpec, TrainingSpecSpec
from kiln.control import kueue
from kiln.control.config import OperatorConfig
from kiln.control.elastic import start_nodes
from kiln.control.observed import Observed
from kiln.control.pytorchjob import Shape, pytorchjob
from kiln.control.replica_groups import ReplicaGroups


class Layout(Protocol):
    elastic_nodes: bool  # whether the elastic loop may change the run's node count

    def job_names(self, run: str) -> list[str]:
        """The run's PyTorchJobs."""

    def read_names(self, run: str) -> list[str]:
        """The PyTorchJobs a reconcile reads (its own, and any of another layout it must not run beside)."""

    def objects(self, doc: TrainingSpec, observed: Observed, config: OperatorConfig, metadata) -> list[dict]:
        """The objects this part adds to a resolved spec's plan, in apply order (its PyTorchJobs last)."""

    def view(self, run: str, found: list[dict]) -> tuple[dict | None, list[dict | None] | None]:
        """(the run's job as kiln.control.status reads it, each group's job or None) from the jobs at hand."""

    def status_inputs(self, kube, job: dict | None, group_jobs, old_status: dict | None) -> dict:
        """What kiln.control.status.derive takes of this part besides the job (its Workloads, read when due)."""


@dataclass(frozen=True)
class SingleJob:
    """One elastic PyTorchJob named as the run, between spec.elastic's node bounds."""
    elastic_nodes = True

    def job_names(self, run: str) -> list[str]:
        return [run]

    def read_names(self, run: str) -> list[str]:
        return [run]

    def objects(self, doc: TrainingSpec, observed: Observed, config: OperatorConfig, metadata) -> list[dict]:
        s = doc.spec
        shape = Shape(observed.nodes or start_nodes(s), s.elastic.min_nodes, s.elastic.max_nodes)
        return [pytorchjob(doc, observed, config, metadata, doc.metadata.name, shape)]

    def view(self, run: str, found: list[dict]) -> tuple[dict | None, None]:
        return next((j for j in found if (j.get("metadata") or {}).get("name") == run), None), None

    def status_inputs(self, kube, job: dict | None, group_jobs, old_status: dict | None) -> dict:
        return {"queue": kueue.observe(kube, job, old_status)}  # why a queued run waits (a Workload read)


SINGLE = SingleJob()


def layout_of(spec: TrainingSpecSpec) -> Layout:
    """The run's part, from a validated spec (kiln.api.layout decides the fault-tolerance mode)."""
    groups = replica_groups(spec)
    return SINGLE if groups <= 1 else ReplicaGroups(groups)


def layout_of_stored(body: dict) -> Layout:
    """The part of a TrainingSpec as stored (not validated yet: a malformed faultTolerance counts as off)."""
    raw = ((body.get("spec") or {}).get("elastic") or {}).get("faultTolerance")
    try:  # the section's own validation bounds groups (MAX_REPLICA_GROUPS)
        groups = fault_tolerance_groups(FaultToleranceSpec.model_validate(raw)) if raw else None
    except ValidationError:
        groups = None
    return SINGLE if (groups or 1) <= 1 else ReplicaGroups(groups)
