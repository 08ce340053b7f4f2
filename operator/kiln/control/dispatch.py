"""What each kopf trigger does, as plain functions of the trigger's data: kiln.control.handlers registers the
handlers and calls these, nothing else. Each one reads its run's objects from kopf's indexes
(kiln.control.indexes) and calls kiln.control.sync.
"""

from __future__ import annotations

import contextvars
import time

import kopf

from kiln.control import indexes, metrics, sync, ticks
from kiln.control.indexes import Indexes
from kiln.control.process import PROCESS, post


def connection() -> kopf.ConnectionInfo:
    """kopf talks to the apiserver with the same credentials as kiln's client (--kubeconfig or in-cluster)."""
    cfg = PROCESS.kube().api.configuration
    auth = cfg.get_api_key_with_prefix("authorization") or ""  # refreshes an in-cluster token if due
    scheme, _, token = auth.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        username=cfg.username or None, password=cfg.password or None,
    )


def spec_changed(body: dict, namespace: str, name: str, logger, retry: int, run_pods: kopf.Index) -> None:
    """A TrainingSpec created, edited or first seen after a start: reconcile it (kopf's body is the
    TrainingSpec as this event delivered it: nothing to read again). A failure retries with sync.backoff_s."""
    try:
        with metrics.reconcile("spec", retry=(sync.Wait,)):
            logger.info(sync.reconcile(PROCESS.kube(), body, PROCESS.config, post,
                                       pods=lambda: indexes.pods(run_pods, (namespace, name))))
    except sync.Wait as wait:
        delay = sync.backoff_s(retry)
        raise kopf.TemporaryError(f"{namespace}/{name}: {wait}; retry {retry + 1} in {delay:.0f}s",
                                  delay=delay) from None
    except Exception as err:  # a bug or a broken connection: kopf's own retry would wait a fixed 60 s
        delay = sync.backoff_s(retry)
        logger.exception("reconcile failed")
        raise kopf.TemporaryError(f"{namespace}/{name}: {type(err).__name__}: {err}; retry {retry + 1} in "
                                  f"{delay:.0f}s", delay=delay) from None


def job_changed(type: str, job: dict, key: indexes.Key, run_jobs: kopf.Index, run_pods: kopf.Index, logger) -> None:
    if type == "DELETED":
        job_deleted(*key, logger)
        return
    if not sync.job_unseen(PROCESS.kube(), *key, job):
        return  # the echo of the operator's own apply: the status already shows this job
    with metrics.reconcile("job"):
        sync.refresh_status(PROCESS.kube(), *key, post, job=lambda: indexes.jobs(run_jobs, key, job),
                            pods=lambda: indexes.pods(run_pods, key), pricing=PROCESS.config.pricing)


def job_deleted(namespace: str, name: str, logger) -> None:
    """Someone deleted a run's PyTorchJob: make it again at once (a TrainingSpec being deleted, or gone,
    takes its job with it: then nothing is made)."""
    kube = PROCESS.kube()
    body = kube.trainingspec(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        with metrics.reconcile("job", retry=(sync.Wait,)):
            logger.info(sync.reconcile(kube, body, PROCESS.config, post, resync=True))
    except sync.Wait as wait:  # SpecAccepted says why; the periodic resync tries again
        logger.warning(f"re-creating the PyTorchJob: {wait}")


def pod_changed(key: indexes.Key, run_jobs: kopf.Index, run_pods: kopf.Index) -> None:
    with metrics.reconcile("pod"):
        sync.refresh_status(PROCESS.kube(), *key, post, job=lambda: indexes.jobs(run_jobs, key),
                            pods=lambda: indexes.pods(run_pods, key), pricing=PROCESS.config.pricing)


def phase_seen(type: str, body, namespace: str, name: str, live: Indexes) -> None:
    """Any TrainingSpec event: the by-phase gauge follows what the apiserver holds (a restarted operator
    re-learns it on listing), and a run seen for the first time gets its periodic tick. In memory only."""
    if PROCESS.indexes is None:
        PROCESS.indexes = live  # kopf's live ones, for the ticks
    if PROCESS.kopf_context is None:
        PROCESS.kopf_context = contextvars.copy_context()  # what kopf.event needs, for the ticks
    if type == "DELETED":
        metrics.forget(namespace, name)
        PROCESS.kube().runs.forget((namespace, name))
    else:
        metrics.observe_status(namespace, name, body.get("status") or {})
        run = PROCESS.kube().runs[(namespace, name)]
        if run.due is None:
            run.due = time.monotonic() + ticks.TICK_S
            run.reconciled_at = run.reconciled_at or time.monotonic()  # the create handler reconciles now
