"""The kopf handlers: thin, each one reads its trigger and calls kiln.control.sync.

Importing this module registers the handlers with kopf's default registry; `run()` starts the operator
(out of cluster with `kiln operator`, in cluster as the image's entry point).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

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
TICK_WORKERS = 8  # threads for the periodic ticks (below), apart from the handlers'


def _kube() -> Kube:
    if "kube" not in _state:
        config: OperatorConfig = _state.setdefault("config", OperatorConfig.from_env())
        _state["kube"] = Kube(api_client(_state.get("kubeconfig"), connections=WORKERS + TICK_WORKERS),
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
    # After its own PATCH kopf waits this long for the watch to deliver the patched version before it trusts
    # an older event. In a burst the watch lags more than kopf's default 5 s: the echo of the status patch
    # a reconcile made (older, without kopf's annotation) then looked like a new creation and most runs were
    # reconciled twice. Longer would also delay a spec edit that lands in the same 0.1 s batch as that patch.
    settings.persistence.consistency_timeout = 15
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


def _one(index: kopf.Index, key: tuple[str, str]) -> dict | None:
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
    key = (namespace, labels[RUN_LABEL])
    job = None if type == "DELETED" else dict(body)
    if job is not None and not sync.job_unseen(*key, job):
        return  # the echo of the operator's own apply: the status already shows this job
    with metrics.reconcile("job"):
        sync.refresh_status(_kube(), *key, _post, job=job, pods=_pods(run_pods, key))


@kopf.on.event("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def pod_changed(namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    key = (namespace, labels[RUN_LABEL])
    with metrics.reconcile("pod"):
        sync.refresh_status(_kube(), *key, _post, job=_one(run_jobs, key), pods=_pods(run_pods, key))


# Every run's periodic tick: the elastic loop and a status refresh (goodput counts on while nothing else
# changes: pending, suspended). Not a kopf.timer: kopf puts a finalizer on every object that has one, which
# costs each new run a PATCH and a watch round trip before its reconcile, and leaves deleting a run waiting
# for the operator. One asyncio task hands due runs to a few threads instead, TICK_S after each run was
# first seen and then every TICK_S (as the timer did).
TICK_S = 15.0
_due: dict[tuple[str, str], float] = {}  # run → when its next tick is due (time.monotonic)
_ticking: set[tuple[str, str]] = set()  # never two ticks of one run at once
_log = logging.getLogger("kiln.operator")


def tick(namespace: str, name: str) -> None:
    key = (namespace, name)
    run_jobs, run_pods = _state["indexes"]
    try:
        # elastic replicas, pods on dead nodes, node avoidance: kiln.control.elastic decides
        with metrics.reconcile("elastic"):
            elastic_sync.tick(_kube(), namespace, name, _state["config"], _post, time.time())
        with metrics.reconcile("status"):
            sync.refresh_status(_kube(), *key, _post, job=_one(run_jobs, key), pods=_pods(run_pods, key))
    except Exception:  # counted by metrics.reconcile; the next tick tries again
        _log.exception("%s/%s: periodic tick failed", namespace, name)
    finally:
        _ticking.discard(key)


async def _tick_due_runs() -> None:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=TICK_WORKERS, thread_name_prefix="kiln-tick") as pool:
        while True:
            await asyncio.sleep(1)
            now = time.monotonic()
            for key, due in list(_due.items()):
                if due <= now and key not in _ticking and "indexes" in _state:
                    _due[key] = now + TICK_S
                    _ticking.add(key)
                    loop.run_in_executor(pool, tick, *key)


@kopf.on.startup()
async def start_ticks(**_) -> None:
    _state["ticks"] = asyncio.get_running_loop().create_task(_tick_due_runs())


@kopf.on.cleanup()
async def stop_ticks(**_) -> None:
    if "ticks" in _state:
        _state.pop("ticks").cancel()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def phase_seen(type, body, namespace, name, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    # The by-phase gauge follows what the apiserver holds; a restarted operator re-learns it on listing.
    # In memory only, so it runs on kopf's event loop: no hop to a worker thread for every event.
    _state.setdefault("indexes", (run_jobs, run_pods))  # kopf's live indexes, for the ticks
    if type == "DELETED":
        metrics.forget(namespace, name)
        sync.forget(_kube(), namespace, name)
        _due.pop((namespace, name), None)
    else:
        metrics.observe_status(namespace, name, body.get("status") or {})
        _due.setdefault((namespace, name), time.monotonic() + TICK_S)


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
