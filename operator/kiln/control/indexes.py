"""kopf's in-memory indexes of what the watches deliver, and how the handlers and the tick read them.

Each run's PyTorchJobs and pods (a status refresh reads neither from the apiserver), and the elastic loop's
view of the cluster (kiln.control.elastic_sync.Seen): every node, and every pod that holds GPUs on one (kopf
watches all pods of the served namespaces anyway, and filters by label on its side). Each event updates one
entry; a tick reads memory, so its cost does not grow with the number of pods and nodes. A pod that stops
holding GPUs indexes to {}, which drops its entry. kiln.control.handlers registers the indexes; the entries
are built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import kopf

from kiln.control.names import GROUP_LABEL

Key = tuple[str, str]  # (namespace, TrainingSpec name)


def pod_entry(namespace: str, meta, spec, status) -> dict:
    """What kiln.control.status and the elastic loop read of a run's pod (of its labels only the replica
    group's: status.replicaGroups counts each group's pods)."""
    labels = meta.get("labels") or {}
    group = {GROUP_LABEL: labels[GROUP_LABEL]} if GROUP_LABEL in labels else {}
    return {"metadata": {"name": meta.get("name"), "namespace": namespace,
                         "deletionTimestamp": meta.get("deletionTimestamp"), "labels": group},
            "spec": {"nodeName": spec.get("nodeName")},
            "status": dict(status)}


def one(index: kopf.Index, key: Key) -> dict | None:
    return next(iter(index.get(key, ())), None)


def jobs(index: kopf.Index, key: Key, fresh: dict | None = None) -> list[dict]:
    """Every PyTorchJob of the run (with replica groups, one per group); fresh: the event's own, newest copy."""
    name = (fresh or {}).get("metadata", {}).get("name")
    return [j for j in index.get(key, ()) if j.get("metadata", {}).get("name") != name] + ([fresh] if fresh else [])


def pods(index: kopf.Index, key: Key) -> list[dict]:
    return list(index.get(key, ()))


def values(index: kopf.Index) -> list:
    """Every entry of an index. Read from a tick's thread while kopf updates the index on its loop: list()
    copies each dict in one step under the GIL, and a key dropped in between reads as empty."""
    return [value for key in list(index) for value in list(index.get(key, ()))]


@dataclass(frozen=True)
class Indexes:
    """kopf's live indexes, as the tick reads them."""
    run_jobs: kopf.Index
    run_pods: kopf.Index
    cluster_nodes: kopf.Index
    gpu_pods: kopf.Index
