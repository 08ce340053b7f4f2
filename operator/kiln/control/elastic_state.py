"""The elastic loop's own state, kept in the TrainingSpec's annotation `kiln.dev/elastic-state` (pure).

The node count the loop chose (and when), the nodes that failed the job, the nodes left for their GPU
health and a move under way (kiln.control.failover), the hang watch and the restart budget: in the
annotation, so a restarted operator continues where the last one was. Read by
kiln.control.sync (a spec edit keeps the chosen count) and kiln.control.elastic_sync (the loop).
"""

from __future__ import annotations

import json

from kiln.api.spec import TrainingSpec
from kiln.control import elastic

ANNOTATION = "kiln.dev/elastic-state"  # not kiln.dev/<handler-id>: kopf keeps its progress there


def state_of(body: dict) -> dict:
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    try:
        state = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {}
    return state if isinstance(state, dict) else {}


def encode(state: dict) -> str:
    return json.dumps(state, sort_keys=True)


def carried_nodes(body: dict, doc: TrainingSpec) -> int | None:
    """The node count the elastic loop chose, if it still fits the (possibly edited) spec; for plan()."""
    n = state_of(body).get("nodes")
    lo, hi = elastic.bounds(doc.spec)
    return n if isinstance(n, int) and lo <= n <= hi and elastic.valid_node_count(doc.spec, n) else None


def avoided(state: dict) -> list[str]:
    """Nodes this run's pods keep off: those that failed it twice (`nodeFailures`) and those it left for
    their GPU health (`gpuAvoid`, kiln.control.failover)."""
    return sorted(set(elastic.nodes_to_avoid(state.get("nodeFailures") or {})) | set(state.get("gpuAvoid") or {}))


def carried_avoid(body: dict) -> tuple[str, ...]:
    """Nodes the elastic loop avoids for this run; for plan()."""
    return tuple(avoided(state_of(body)))
