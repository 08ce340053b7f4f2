"""Prometheus metrics of the operator: reconciles, errors, reconcile latency and TrainingSpecs by phase.

Handlers call these functions; nothing here talks to Kubernetes. Metrics live in their own registry
(`REGISTRY`), so a test can read them and a second operator in one process cannot collide with them;
`serve(port)` exposes it on http://:<port>/metrics together with the process's CPU and memory.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from contextlib import contextmanager
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily

# The phases of DESIGN.md §3; each one is exported (as 0 when empty) so dashboards need no `or vector(0)`.
PHASES = ("Pending", "Running", "Scaling", "Restarting", "Suspended", "Succeeded", "Failed")

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

RECONCILES = Counter(
    "kiln_operator_reconciles_total",
    "Reconciles run by the operator, by handler and outcome (ok | retry | error).",
    ["handler", "outcome"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "kiln_operator_reconcile_errors_total",
    "Reconciles that failed, by handler and error type (the exception's class name).",
    ["handler", "error"],
    registry=REGISTRY,
)
DURATION = Histogram(
    "kiln_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, by handler.",
    ["handler"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)


class _Phases:
    """The last phase seen of every TrainingSpec; collected as `kiln_operator_trainingspecs{namespace,phase}`.

    Keeping per-object phases (not counters) makes the gauge right after any sequence of updates, deletes
    and operator restarts: a restarted operator re-learns every phase on its initial listing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            self._phase[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phase.pop((namespace, name), None)

    def collect(self):
        with self._lock:
            counts = Tally((ns, phase) for (ns, _), phase in self._phase.items())
        family = GaugeMetricFamily(
            "kiln_operator_trainingspecs", "TrainingSpecs known to the operator, by namespace and phase.",
            labels=["namespace", "phase"],
        )
        for namespace in sorted({ns for ns, _ in counts}):
            for phase in PHASES + tuple(sorted({p for _, p in counts} - set(PHASES))):
                family.add_metric([namespace, phase], counts.get((namespace, phase), 0))
        yield family


_PHASES = _Phases()
REGISTRY.register(_PHASES)


@contextmanager
def reconcile(handler: str, retry: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Count and time one reconcile. An exception of a `retry` type (the reconcile must wait for something)
    counts as outcome "retry"; any other counts as an error, by type. Both are re-raised."""
    start = time.perf_counter()
    try:
        yield
    except retry:
        RECONCILES.labels(handler, "retry").inc()
        raise
    except Exception as err:
        RECONCILES.labels(handler, "error").inc()
        ERRORS.labels(handler, type(err).__name__).inc()
        raise
    else:
        RECONCILES.labels(handler, "ok").inc()
    finally:
        DURATION.labels(handler).observe(time.perf_counter() - start)


def set_phase(namespace: str, name: str, phase: str) -> None:
    """Record the phase the operator last wrote (or read) for one TrainingSpec."""
    _PHASES.set(namespace, name, phase)


def forget(namespace: str, name: str) -> None:
    """A TrainingSpec was deleted: it no longer counts in any phase."""
    _PHASES.forget(namespace, name)


def serve(port: int, addr: str = "0.0.0.0"):
    """Expose the registry on http://<addr>:<port>/metrics from a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=REGISTRY)
