"""What the operator saw in the cluster that a plan depends on (kiln.control.plan, kiln.control.pytorchjob)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.control.kueue import Coverage


@dataclass(frozen=True)
class Observed:
    """What the operator saw in the cluster that the plan depends on."""

    applied: dict | None = None  # the resolved spec in the existing ConfigMap (what the job runs with)
    job_active: bool = False  # a PyTorchJob exists and has not finished
    nodes: int | None = None  # the elastic controller's current node decision; None: spec.resources.nodes
    avoid_nodes: tuple[str, ...] = ()  # nodes that failed this run twice (kiln.control.elastic)
    queue_coverage: Coverage | None = None  # what the run's ClusterQueue covers (None: not known, or no queue)
    left_out: tuple[str, ...] | None = None  # the requests left out of the live job (None: no live job)
