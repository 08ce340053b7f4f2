"""The kopf handlers: thin, each one reads its trigger and calls kiln.control.sync.

Importing this module registers the handlers with kopf's default registry; `run()` starts the operator
(out of cluster with `kiln operator`, in cluster as the image's entry point).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import kopf

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control import elastic_sync, kopf_fix, leader, metrics, sync
from kiln.control.config import OperatorConfig
from kiln.control.kube import Kube, api_client
from kiln.control.plan import GROUP_LABEL, RUN_LABEL
from kiln.control.status import Event

kopf_fix.apply()  # kopf's startup with indexes is O(pods^2) without it

# The process's singletons: config, the Kube client (which holds every run's state, kube.runs), kopf's
# indexes for the ticks, the watched namespaces (None: all) and the tick task.
_state: dict = {}
# Threads running the handlers (kopf's executor). A reconcile spends most of its time waiting for the
# apiserver, so a burst of new runs drains faster with many in flight; each thread keeps its connection.
WORKERS = 32
TICK_WORKERS = 8  # threads for the periodic ticks (below), apart from the handlers'


def _kube() -> Kube:
    if "kube" not in _state:
        config: OperatorConfig = _state.setdefault("config", OperatorConfig.from_env())
        _state["kube"] = Kube(api_client(_state.get("kubeconfig"), connections=WORKERS + TICK_WORKERS),
                              field_manager=config.field_manager, resync_seconds=config.resync_seconds)
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


class MemoryDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base, the TrainingSpec's essence as last handled, kept in this process's memory (kube.runs)
    instead of kopf's `last-handled-configuration` annotation: that annotation cost every new run and every
    spec edit one more TrainingSpec write (12-15 ms of apiserver CPU: the CRD's schema and CEL rules run on
    every write) and a watch event.

    Sound across restarts and leader handovers: a process starts with nothing remembered, so kopf sees each
    run's first event as a creation and the handler reconciles it, as the resume handler did with the
    annotation (a spec edited meanwhile is acted on; an unchanged run costs the same reads and applies, and
    no write its objects do not need). What it acted on is in the status (`observedGeneration`).
    Keyed by uid: a TrainingSpec deleted and made again under the same name is a new run."""

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        meta = body.get("metadata") or {}
        run = _kube().runs.get((meta.get("namespace"), meta.get("name")))
        handled = run.handled if run is not None else None
        return handled[1] if handled is not None and handled[0] == meta.get("uid") else None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        meta = body.get("metadata") or {}
        _kube().runs[(meta.get("namespace"), meta.get("name"))].handled = (meta.get("uid"), essence)


class RetryAnnotations(kopf.AnnotationsProgressStorage):
    """kopf's progress records as annotations (the status schema is kiln's own and prunes unknown fields),
    without kopf's `kiln.dev/kopf-managed` marker: kopf adds it whenever it records a handler's progress, even
    a first try that succeeds and leaves no record, so it cost every new run a PATCH of its own (the marker
    only tells other kopf operators to ignore kiln.dev annotations). Records remain only while a reconcile
    retries."""

    def _store_marker(self, prefix: str, patch: kopf.Patch, body: kopf.Body) -> None:  # kopf 1.45 (pinned)
        pass


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.progress_storage = RetryAnnotations(prefix="kiln.dev")
    settings.persistence.diffbase_storage = MemoryDiffBase()  # not an annotation either
    settings.posting.level = logging.WARNING  # Events on TrainingSpecs are kiln's own, plus kopf's failures
    settings.execution.max_workers = WORKERS
    # After its own PATCH (now only a retry's progress annotation) kopf waits this long for the watch to
    # deliver the patched version before it trusts an older event; in a burst the watch lagged more than
    # kopf's default 5 s. Longer would also delay a spec edit that lands in the same 0.1 s batch as that patch.
    settings.persistence.consistency_timeout = 15
    settings.watching.server_timeout = 300


# Each run's PyTorchJob and pods as the watches deliver them (kopf keeps these indexes in memory and
# passes them to every handler): a status refresh reads neither from the apiserver.
@kopf.index("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def run_jobs(namespace, labels, body, **_) -> dict:
    return {(namespace, labels[RUN_LABEL]): dict(body)}


@kopf.index("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def run_pods(namespace, labels, meta, spec, status, **_) -> dict:
    # what kiln.control.status and the elastic loop read of a pod
    # (of its labels only the replica group's: status.replicaGroups counts each group's pods)
    group = {GROUP_LABEL: labels[GROUP_LABEL]} if GROUP_LABEL in labels else {}
    return {(namespace, labels[RUN_LABEL]): {"metadata": {"name": meta.get("name"), "namespace": namespace,
                                                          "deletionTimestamp": meta.get("deletionTimestamp"),
                                                          "labels": group},
                                             "spec": {"nodeName": spec.get("nodeName")},
                                             "status": dict(status)}}


# The elastic loop's view of the cluster (kiln.control.elastic_sync.Seen), kept by the watches: every node,
# and every pod that holds GPUs on one (kopf watches all pods of the served namespaces anyway, and filters
# by label on its side). Each event updates one entry; a tick reads memory, so its cost no longer grows with
# the number of pods and nodes (it listed both every 15 s per run before). A pod that stops holding GPUs
# indexes to {}, which drops its entry.
@kopf.index("", "v1", "nodes")
def cluster_nodes(body, **_) -> dict:
    return {body["metadata"]["name"]: elastic_sync.node_summary(body)}


@kopf.index("", "v1", "pods")
def gpu_pods(body, **_) -> dict:
    held = elastic_sync.gpu_holding(body)
    return {} if held is None else {held.node: held}


def _one(index: kopf.Index, key: tuple[str, str]) -> dict | None:
    return next(iter(index.get(key, ())), None)


def _jobs(index: kopf.Index, key: tuple[str, str], fresh: dict | None = None) -> list[dict]:
    # every PyTorchJob of the run (with replica groups, one per group); fresh: the event's own, newest copy
    name = (fresh or {}).get("metadata", {}).get("name")
    return [j for j in index.get(key, ()) if j.get("metadata", {}).get("name") != name] + ([fresh] if fresh else [])


def _pods(index: kopf.Index, key: tuple[str, str]) -> list[dict]:
    return list(index.get(key, ()))


def _all(index: kopf.Index) -> list:
    # Read from a tick's thread while kopf updates the index on its loop: list() copies each dict in one
    # step under the GIL, and a key dropped in between reads as empty.
    return [value for key in list(index) for value in list(index.get(key, ()))]


@kopf.on.resume(GROUP, VERSION, PLURAL)  # kopf calls it a creation after a start (MemoryDiffBase): either way
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body, namespace, name, logger, retry: int, run_pods: kopf.Index, **_) -> None:
    # kopf's body is the TrainingSpec as this event delivered it: nothing to read again
    try:
        with metrics.reconcile("spec", retry=(sync.Wait,)):
            logger.info(sync.reconcile(_kube(), dict(body), _state["config"], _post,
                                       pods=_pods(run_pods, (namespace, name))))
    except sync.Wait as wait:
        delay = sync.backoff_s(retry)
        raise kopf.TemporaryError(f"{namespace}/{name}: {wait}; retry {retry + 1} in {delay:.0f}s",
                                  delay=delay) from None
    except Exception as err:  # a bug or a broken connection: kopf's own retry would wait a fixed 60 s
        delay = sync.backoff_s(retry)
        logger.exception("reconcile failed")
        raise kopf.TemporaryError(f"{namespace}/{name}: {type(err).__name__}: {err}; retry {retry + 1} in "
                                  f"{delay:.0f}s", delay=delay) from None


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={RUN_LABEL: kopf.PRESENT})
def job_changed(type, body, namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, logger, **_) -> None:
    key = (namespace, labels[RUN_LABEL])
    if type == "DELETED":
        _job_deleted(*key, logger)
        return
    job = dict(body)
    if not sync.job_unseen(_kube(), *key, job):
        return  # the echo of the operator's own apply: the status already shows this job
    with metrics.reconcile("job"):
        sync.refresh_status(_kube(), *key, _post, job=_jobs(run_jobs, key, job), pods=_pods(run_pods, key),
                            pricing=_state["config"].pricing)


def _job_deleted(namespace: str, name: str, logger) -> None:
    """Someone deleted a run's PyTorchJob: make it again at once (a TrainingSpec being deleted, or gone,
    takes its job with it: then nothing is made)."""
    kube = _kube()
    body = kube.trainingspec(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        with metrics.reconcile("job", retry=(sync.Wait,)):
            logger.info(sync.reconcile(kube, body, _state["config"], _post, resync=True))
    except sync.Wait as wait:  # SpecAccepted says why; the periodic resync tries again
        logger.warning(f"re-creating the PyTorchJob: {wait}")


@kopf.on.event("", "v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def pod_changed(namespace, labels, run_jobs: kopf.Index, run_pods: kopf.Index, **_) -> None:
    key = (namespace, labels[RUN_LABEL])
    with metrics.reconcile("pod"):
        sync.refresh_status(_kube(), *key, _post, job=_jobs(run_jobs, key), pods=_pods(run_pods, key),
                            pricing=_state["config"].pricing)


# Every run's periodic tick: the elastic loop, the periodic resync (every resync_seconds each object of the
# run is applied again, which puts back what someone else deleted or changed), and a status refresh (goodput
# counts on while nothing else changes: pending, suspended). Not a kopf.timer: kopf puts a finalizer on every
# object that has one, which costs each new run a PATCH and a watch round trip before its reconcile, and
# leaves deleting a run waiting for the operator. One asyncio task hands due runs to a few threads instead,
# TICK_S after each run was first seen and then every TICK_S (as the timer did).
TICK_S = 15.0
_log = logging.getLogger("kiln.operator")


def tick(namespace: str, name: str) -> None:
    key = (namespace, name)
    kube, config = _kube(), _state["config"]
    run_jobs, run_pods, nodes, gpus = _state["indexes"]
    try:
        # elastic replicas, pods on dead nodes, node avoidance: kiln.control.elastic decides
        with metrics.reconcile("elastic"):
            seen = elastic_sync.Seen(_all(nodes), _all(gpus), _one(run_jobs, key), _pods(run_pods, key))
            elastic_sync.tick(kube, namespace, name, config, _post, time.time(), seen)
        body = kube.last_spec(namespace, name)  # as the elastic tick just read it
        if body is not None and time.monotonic() - kube.runs[key].reconciled_at >= kube.resync_seconds:
            with metrics.reconcile("resync", retry=(sync.Wait,)):
                try:
                    sync.reconcile(kube, body, config, _post, pods=_pods(run_pods, key), resync=True)
                except sync.Wait as wait:  # SpecAccepted says why; the next resync tries again
                    _log.warning("%s/%s: resync: %s", namespace, name, wait)
        with metrics.reconcile("status"):
            sync.refresh_status(kube, *key, _post, job=_jobs(run_jobs, key), pods=_pods(run_pods, key),
                            pricing=_state["config"].pricing)
    except Exception:  # counted by metrics.reconcile; the next tick tries again
        _log.exception("%s/%s: periodic tick failed", namespace, name)
    finally:
        kube.runs[key].ticking = False


async def _tick_due_runs() -> None:
    loop = asyncio.get_running_loop()
    runs = _kube().runs
    with ThreadPoolExecutor(max_workers=TICK_WORKERS, thread_name_prefix="kiln-tick") as pool:
        while True:
            await asyncio.sleep(1)
            now = time.monotonic()
            for key, run in runs.items():
                if run.due is not None and run.due <= now and not run.ticking and "kopf_context" in _state:
                    run.due, run.ticking = now + TICK_S, True
                    # kopf.event needs kopf's context (its settings and event queue, set for its handlers),
                    # which an executor thread does not inherit: without it a tick's Event raised LookupError,
                    # which ended the tick after its apply and before it recorded the elastic state
                    loop.run_in_executor(pool, _state["kopf_context"].copy().run, tick, *key)


@kopf.on.startup()
async def start_ticks(**_) -> None:
    _state["ticks"] = asyncio.get_running_loop().create_task(_tick_due_runs())


@kopf.on.cleanup()
async def stop_ticks(**_) -> None:
    if "ticks" in _state:
        _state.pop("ticks").cancel()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def phase_seen(type, body, namespace, name, run_jobs: kopf.Index, run_pods: kopf.Index,
                     cluster_nodes: kopf.Index, gpu_pods: kopf.Index, **_) -> None:
    # The by-phase gauge follows what the apiserver holds; a restarted operator re-learns it on listing.
    # In memory only, so it runs on kopf's event loop: no hop to a worker thread for every event.
    _state.setdefault("indexes", (run_jobs, run_pods, cluster_nodes, gpu_pods))  # kopf's live ones, for the ticks
    _state.setdefault("kopf_context", contextvars.copy_context())  # what kopf.event needs, for the ticks
    if type == "DELETED":
        metrics.forget(namespace, name)
        _kube().runs.forget((namespace, name))
    else:
        metrics.observe_status(namespace, name, body.get("status") or {})
        run = _kube().runs[(namespace, name)]
        if run.due is None:
            run.due = time.monotonic() + TICK_S
            run.reconciled_at = run.reconciled_at or time.monotonic()  # the create handler reconciles now


def run(namespaces: list[str] | None = None, kubeconfig: str | None = None,
        config: OperatorConfig | None = None, health: str | None = None, lease: str | None = None) -> None:
    """Run the operator until interrupted. health: e.g. http://0.0.0.0:8080/healthz (None: no endpoint).
    lease: `[NAMESPACE/]NAME` of the leader election Lease (kiln.control.leader.location)."""
    _state["config"] = config or OperatorConfig.from_env()
    _state["kubeconfig"] = kubeconfig
    _state["namespaces"] = list(namespaces) if namespaces else None
    kube = _kube()  # fail early, with a message, on missing credentials
    kopf.configure(verbose=False)  # INFO: one line per handled spec change, start and retry
    if _state["config"].metrics_port:
        metrics.serve(_state["config"].metrics_port)
    env = dict(os.environ)
    where = leader.location(lease or _state["config"].leader_lease, env, leader.sa_namespace(), namespaces)
    elector = leader.Elector(kube, *where, leader.identity(env))
    asyncio.run(_lead_then_operate(elector, namespaces, health))
    if elector.lost:
        raise SystemExit(f"kiln operator: lost {elector.where}; exiting so that a restart waits as a standby")


async def _lead_then_operate(elector: leader.Elector, namespaces: list[str] | None, health: str | None) -> None:
    # A standby answers /healthz (it is alive) but starts no watch until it holds the Lease.
    standby = await _serve_health(health) if health else None
    try:
        await elector.acquire()
    finally:
        if standby is not None:
            await standby.cleanup()  # kopf serves /healthz on the same port from here on
    stop = asyncio.Event()
    keeper = asyncio.create_task(elector.keep(on_lost=stop.set))
    try:
        await kopf.operator(
            standalone=True,  # no kopf peering objects: the Lease above decides who acts
            clusterwide=not namespaces,
            namespaces=namespaces or [],
            liveness_endpoint=health,
            stop_flag=stop,
        )
    finally:
        keeper.cancel()
        if not elector.lost:
            await elector.release()


async def _serve_health(url: str):
    from urllib.parse import urlparse

    from aiohttp import web

    parsed = urlparse(url)

    async def ok(_request):
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get(parsed.path or "/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, parsed.hostname, parsed.port, reuse_address=True).start()
    return runner
