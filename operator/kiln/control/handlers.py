"""The kopf handlers: thin, each one reads its trigger and calls kiln.control.sync.

Importing this module registers the handlers with kopf's default registry; `run()` starts the operator
(out of cluster with `kiln operator`, in cluster as the image's entry point).
"""

from __future__ import annotations

import asyncio
import logging
import time

import kopf

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control import elastic_sync, metrics, sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.plan import RUN_LABEL
from kiln.control.status import Event

_state: dict = {}
# Threads running the handlers (kopf's executor). A reconcile spends most of its time waiting for the
# apiserver, so a burst of new runs drains faster with many in flight; each thread keeps its connection.
WORKERS = 32


def _kube() -> Kube:
    if "kube" not in _state:
        config: OperatorConfig = _state.setdefault("config", OperatorConfig.from_env())
        _state["kube"] = Kube(api_client(_state.get("kubeconfig"), connections=WORKERS),
                              field_manager=config.field_manager)
    return _state["kube"]


def _post(body: dict, event: Event) -> None:
    kopf.event(body, type=event.type, reason=event.reason, message=event.message)


@kopf.on.login()
def login(**_) -> kopf.ConnectionInfo:
    # kopf talks to the apiserver with the same credentials as kiln's client (--kubeconfig or in-cluster).
    cfg = _kube().api.configuration
    auth = cfg.get_api_key_with_prefix("authorization") or ""  # refreshes an in-cluster token if due
    scheme, _, token = auth.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        username=cfg.username or None, password=cfg.password or None,
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # kopf's bookkeeping goes to annotations: the status schema is kiln's own and prunes unknown fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kiln.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kiln.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events on TrainingSpecs are kiln's own, plus kopf's failures
    settings.execution.max_workers = WORKERS
    settings.watching.server_timeout = 300


# Each run's PyTorchJob and pods as the watches deliver them (kopf keeps these indexes in memory and
# passes them to every handler): a status refresh reads neither from the apiserver.
@kopf.index("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def run_jobs(namespace, labels, body, **_) -> dict:
    return {(namespace, labels[RUN_LABEL]): dict(body)}


@kopf.index("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def run_pods(namespace, labels, meta, status, **_) -> dict:
    # what kiln.control.status reads of a pod, not its spec
    return {(namespace, labels[RUN_LABEL]): {"metadata": {"name": meta.get("name"), "namespace": namespace,
                                                          "deletionTimestamp": meta.get("deletionTimestamp")},
                                             "status": dict(status)}}


def _job(index: kopf.Index, key: tuple[str, str]) -> dict | None:
    return next(iter(index.get(key, ())), None)


def _pods(index: kopf.Index, key: tuple[str, str]) -> list[dict]:
    return list(index.get(key, ()))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body, namespace, name, logger, run_pods: kopf.Index, **_) -> None:
    # kopf's body is the TrainingSpec as this event delivered it: nothing to read again
    try:
        with metrics.reconcile("spec", retry=(sync.Wait,)):
            logger.info(sync.reconcile(_kube(), dict(body), _state["config"], _post,
                                       pods=_pods(run_pods, (namespace, name))))
    except sync.Wait as wait:
        raise kopf.TemporaryError(str(wait), delay=10) from None


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def job_changed(type, body, namespace, labels, run_pods: kopf.Index, **_) -> None:
    run = labels[RUN_LABEL]
    job = None if type == "DELETED" else dict(body)
    if job is not None and not sync.job_unseen(namespace, run, job):
        return  # the echo of the operator's own apply: the status already shows this job
    with metrics.reconcile("job"):
        sync.refresh_status(_kube(), namespace, run, _post, job=job, pods=_pods(run_pods, (namespace, run)))


@kopf.on.event("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def pod_changed(namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    key = (namespace, labels[RUN_LABEL])
    with metrics.reconcile("pod"):
        sync.refresh_status(_kube(), *key, _post, job=_job(run_jobs, key), pods=_pods(run_pods, key))


@kopf.timer(GROUP, VERSION, PLURAL, interval=15, initial_delay=15)
def elastic_tick(namespace, name, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    # elastic replicas, pods on dead nodes, node avoidance: kiln.control.elastic decides
    with metrics.reconcile("elastic"):
        elastic_sync.tick(_kube(), namespace, name, _state["config"], _post, time.time())
    with metrics.reconcile("status"):  # goodput counts on while nothing else changes (pending, suspended)
        key = (namespace, name)
        sync.refresh_status(_kube(), *key, _post, job=_job(run_jobs, key), pods=_pods(run_pods, key))


@kopf.on.event(GROUP, VERSION, PLURAL)
def phase_seen(type, body, namespace, name, **_) -> None:
    # The by-phase gauge follows what the apiserver holds; a restarted operator re-learns it on listing.
    if type == "DELETED":
        metrics.forget(namespace, name)
        sync.forget(namespace, name)
    else:
        metrics.set_phase(namespace, name, (body.get("status") or {}).get("phase") or "Pending")


def run(namespaces: list[str] | None = None, kubeconfig: str | None = None,
        config: OperatorConfig | None = None, health: str | None = None) -> None:
    """Run the operator until interrupted. health: e.g. http://0.0.0.0:8080/healthz (None: no endpoint)."""
    _state["config"] = config or OperatorConfig.from_env()
    _state["kubeconfig"] = kubeconfig
    _kube()  # fail early, with a message, on missing credentials
    kopf.configure(verbose=False)  # INFO: one line per handled spec change, resume and retry
    if _state["config"].metrics_port:
        metrics.serve(_state["config"].metrics_port)
    asyncio.run(kopf.operator(
        standalone=True,  # no peering objects; run one replica (leader election is the Deployment's job)
        clusterwide=not namespaces,
        namespaces=namespaces or [],
        liveness_endpoint=health,
    ))
