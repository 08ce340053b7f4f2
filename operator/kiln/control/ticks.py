"""Every run's periodic tick: the elastic loop, the periodic resync (every resync_seconds each object of the
run is applied again, which puts back what someone else deleted or changed) and a status refresh (goodput
counts on while nothing else changes: pending, suspended).

Not a kopf.timer: kopf puts a finalizer on every object that has one, which costs each new run a PATCH and a
watch round trip before its reconcile, and leaves deleting a run waiting for the operator. One asyncio task
hands due runs to a few threads instead, TICK_S after each run was first seen and then every TICK_S (as the
timer did).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kiln.control import elastic_sync, indexes, metrics, sync
from kiln.control.process import PROCESS, TICK_WORKERS, post

TICK_S = 15.0
_log = logging.getLogger("kiln.operator")


def tick(namespace: str, name: str) -> None:
    key = (namespace, name)
    kube, config = PROCESS.kube(), PROCESS.config
    live = PROCESS.indexes
    try:
        # elastic replicas, pods on dead nodes, node avoidance: kiln.control.elastic decides
        with metrics.reconcile("elastic"):
            seen = lambda: elastic_sync.Seen(indexes.values(live.cluster_nodes),  # noqa: E731 - read under the lock
                                             indexes.values(live.gpu_pods), indexes.one(live.run_jobs, key),
                                             indexes.pods(live.run_pods, key))
            elastic_sync.tick(kube, namespace, name, config, post, time.time, seen)  # both read under the lock
        body = kube.last_spec(namespace, name)  # as the elastic tick just read it
        if body is not None and time.monotonic() - kube.runs[key].reconciled_at >= kube.resync_seconds:
            with metrics.reconcile("resync", retry=(sync.Wait,)):
                try:
                    sync.reconcile(kube, body, config, post, pods=lambda: indexes.pods(live.run_pods, key),
                                   resync=True)
                except sync.Wait as wait:  # SpecAccepted says why; the next resync tries again
                    _log.warning("%s/%s: resync: %s", namespace, name, wait)
        with metrics.reconcile("status"):
            sync.refresh_status(kube, *key, post, job=lambda: indexes.jobs(live.run_jobs, key),
                                pods=lambda: indexes.pods(live.run_pods, key), pricing=config.pricing)
    except Exception:  # counted by metrics.reconcile; the next tick tries again
        _log.exception("%s/%s: periodic tick failed", namespace, name)
    finally:
        kube.runs[key].ticking = False


async def tick_due_runs() -> None:
    """Forever: each second, hand every run whose tick is due (and not running) to a tick thread."""
    loop = asyncio.get_running_loop()
    runs = PROCESS.kube().runs
    with ThreadPoolExecutor(max_workers=TICK_WORKERS, thread_name_prefix="kiln-tick") as pool:
        while True:
            await asyncio.sleep(1)
            now = time.monotonic()
            for key, run in runs.items():
                if run.due is not None and run.due <= now and not run.ticking and PROCESS.kopf_context is not None:
                    run.due, run.ticking = now + TICK_S, True
                    # kopf.event needs kopf's context (its settings and event queue, set for its handlers),
                    # which an executor thread does not inherit: without it a tick's Event raised LookupError,
                    # which ended the tick after its apply and before it recorded the elastic state
                    loop.run_in_executor(pool, PROCESS.kopf_context.copy().run, tick, *key)
