"""The kopf handlers: the operator's kopf surface and nothing else. Each one passes its trigger's data to a
plain function (kiln.control.dispatch, kiln.control.ticks, kiln.control.kopf_settings, kiln.control.indexes).

Importing this module registers the handlers with kopf's default registry; kiln.control.serve.run starts the
operator.
"""

from __future__ import annotations

import asyncio

import kopf

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control import dispatch, elastic_sync, indexes, kopf_fix, kopf_settings, ticks
from kiln.control.indexes import Indexes
from kiln.control.names import RUN_LABEL
from kiln.control.process import PROCESS, WORKERS

kopf_fix.apply()  # kopf's startup with indexes is O(pods^2) without it


@kopf.on.login()
def login(**_) -> kopf.ConnectionInfo:
    return dispatch.connection()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    kopf_settings.configure(settings, lambda: PROCESS.kube().runs, WORKERS)


@kopf.index("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def run_jobs(namespace, labels, body, **_) -> dict:
    return {(namespace, labels[RUN_LABEL]): dict(body)}


@kopf.index("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def run_pods(namespace, labels, meta, spec, status, **_) -> dict:
    return {(namespace, labels[RUN_LABEL]): indexes.pod_entry(namespace, meta, spec, status)}


@kopf.index("", "v1", "nodes")
def cluster_nodes(body, **_) -> dict:
    return {body["metadata"]["name"]: elastic_sync.node_summary(body)}


@kopf.index("", "v1", "pods")
def gpu_pods(body, **_) -> dict:
    held = elastic_sync.gpu_holding(body)
    return {} if held is None else {held.node: held}


@kopf.on.resume(GROUP, VERSION, PLURAL)  # kopf calls it a creation after a start (MemoryDiffBase): either way
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body, namespace, name, logger, retry: int, run_pods: kopf.Index, **_) -> None:
    dispatch.spec_changed(dict(body), namespace, name, logger, retry, run_pods)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def job_changed(type, body, namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, logger, **_) -> None:
    dispatch.job_changed(type, dict(body), (namespace, labels[RUN_LABEL]), run_jobs, run_pods, logger)


@kopf.on.event("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def pod_changed(namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    dispatch.pod_changed((namespace, labels[RUN_LABEL]), run_jobs, run_pods)


@kopf.on.startup()
async def start_ticks(**_) -> None:
    PROCESS.ticks = asyncio.get_running_loop().create_task(ticks.tick_due_runs())


@kopf.on.cleanup()
async def stop_ticks(**_) -> None:
    if PROCESS.ticks is not None:
        PROCESS.ticks.cancel()
        PROCESS.ticks = None


@kopf.on.event(GROUP, VERSION, PLURAL)
async def phase_seen(type, body, namespace, name, run_jobs: kopf.Index, run_pods: kopf.Index,
                     cluster_nodes: kopf.Index, gpu_pods: kopf.Index, **_) -> None:
    # on kopf's event loop (memory only): no hop to a worker thread for every event
    dispatch.phase_seen(type, body, namespace, name, Indexes(run_jobs, run_pods, cluster_nodes, gpu_pods))
