"""kopf's settings for kiln: where kopf keeps its diff base and retry records, and its executor and timeouts.

kiln.control.handlers' startup handler calls `configure`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import kopf

from kiln.control.runs import Runs


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

    def __init__(self, runs: Callable[[], Runs]) -> None:
        super().__init__()
        self._runs = runs  # the process's (read when kopf asks: the Kube client is made on first use)

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        meta = body.get("metadata") or {}
        run = self._runs().get((meta.get("namespace"), meta.get("name")))
        handled = run.handled if run is not None else None
        return handled[1] if handled is not None and handled[0] == meta.get("uid") else None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        meta = body.get("metadata") or {}
        self._runs()[(meta.get("namespace"), meta.get("name"))].handled = (meta.get("uid"), essence)


class RetryAnnotations(kopf.AnnotationsProgressStorage):
    """kopf's progress records as annotations (the status schema is kiln's own and prunes unknown fields),
    without kopf's `kiln.dev/kopf-managed` marker: kopf adds it whenever it records a handler's progress, even
    a first try that succeeds and leaves no record, so it cost every new run a PATCH of its own (the marker
    only tells other kopf operators to ignore kiln.dev annotations). Records remain only while a reconcile
    retries."""

    def _store_marker(self, prefix: str, patch: kopf.Patch, body: kopf.Body) -> None:  # kopf 1.45 (pinned)
        pass


def configure(settings: kopf.OperatorSettings, runs: Callable[[], Runs], workers: int) -> None:
    settings.persistence.progress_storage = RetryAnnotations(prefix="kiln.dev")
    settings.persistence.diffbase_storage = MemoryDiffBase(runs)  # not an annotation either
    settings.posting.level = logging.WARNING  # Events on TrainingSpecs are kiln's own, plus kopf's failures
    settings.execution.max_workers = workers
    # After its own PATCH (now only a retry's progress annotation) kopf waits this long for the watch to
    # deliver the patched version before it trusts an older event; in a burst the watch lagged more than
    # kopf's default 5 s. Longer would also delay a spec edit that lands in the same 0.1 s batch as that patch.
    settings.persistence.consistency_timeout = 15
    settings.watching.server_timeout = 300
