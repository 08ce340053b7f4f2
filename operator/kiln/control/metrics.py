"""Prometheus metrics of the operator: reconciles, errors, reconcile latency, TrainingSpecs by phase, and each
run's goodput and restarts (the status fields the operator owns: kiln.api.contract.OPERATOR_STATUS).

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
    """The last phase seen of every TrainingSpec; collected as `kiln_operator_trainingspecs{namespace,phase}`,
    and its goodput and restarts as `kiln_operator_run_goodput` / `kiln_operator_run_restarts{namespace,run}`.

    Keeping per-object values (not counters) makes the gauges right after any sequence of updates, deletes
    and operator restarts: a restarted operator re-learns every run on its initial listing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: dict[tuple[str, str], str] = {}
        self._run: dict[tuple[str, str], dict[str, float]] = {}  # goodput, restarts: only what status holds

    def set(self, namespace: str, name: str, phase: str, values: dict[str, float] | None = None) -> None:
        with self._lock:
            self._phase[(namespace, name)] = phase
            if values is not None:
                self._run[(namespace, name)] = values

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phase.pop((namespace, name), None)
            self._run.pop((namespace, name), None)

    def collect(self):
        with self._lock:
            counts = Tally((ns, phase) for (ns, _), phase in self._phase.items())
            runs = sorted(self._run.items())
        for field, name, doc in RUN_GAUGES:
            run_family = GaugeMetricFamily(name, doc, labels=["namespace", "run"])
            for (ns, run), values in runs:
                if field in values:
                    run_family.add_metric([ns, run], values[field])
            yield run_family
        for prefix, name, doc, label in LABELLED_GAUGES:  # status.cost by cause, status.scaling by node count
            labelled = GaugeMetricFamily(name, doc, labels=["namespace", "run", label])
            for (ns, run), values in runs:
                for key, value in values.items():
                    if key.startswith(prefix):
                        labelled.add_metric([ns, run, key[len(prefix):]], value)
            yield labelled
        family = GaugeMetricFamily(
            "kiln_operator_trainingspecs", "TrainingSpecs known to the operator, by namespace and phase.",
            labels=["namespace", "phase"],
        )
        for namespace in sorted({ns for ns, _ in counts}):
            for phase in PHASES + tuple(sorted({p for _, p in counts} - set(PHASES))):
                family.add_metric([namespace, phase], counts.get((namespace, phase), 0))
        yield family


# status field -> (gauge, help): the run-level series of the dashboard that the operator, their writer, exports
RUN_GAUGES = (
    ("goodput", "kiln_operator_run_goodput", "Productive step time / wall time since the run was created (0..1)."),
    ("restarts", "kiln_operator_run_restarts", "Times the run's PyTorchJob entered Restarting."),
)
# status.cost.<field> by cause (kiln.control.goodput.GPU_CAUSES) and status.scaling by node count ->
# (value key prefix, gauge, help, label)
COST_GAUGES = (
    ("gpuHoursByCause.", "kiln_operator_run_gpu_hours", "GPU-hours the run held, by cause (they add up to the total).",
     "cause"),
    ("amountByCause.", "kiln_operator_run_cost", "What the run's GPU-hours cost, by cause, in status.cost.currency "
                                                 "(only where the platform set a price for its gpuType).", "cause"),
)
SCALING_GAUGE = ("scalingEfficiency.", "kiln_operator_run_scaling_efficiency",
                 "Tokens/s per worker at a node count / at the run's first node count (status.scaling).", "nodes")
LABELLED_GAUGES = (*COST_GAUGES, SCALING_GAUGE)
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


def observe_status(namespace: str, name: str, status: dict) -> None:
    """Record a TrainingSpec's status as the apiserver holds it: its phase, goodput and restarts."""
    values = {field: float(status[field]) for field, _, _ in RUN_GAUGES
              if isinstance(status.get(field), (int, float)) and not isinstance(status.get(field), bool)}
    cost = status.get("cost") or {}
    for prefix, _, _, _ in COST_GAUGES:
        by_cause = cost.get(prefix.rstrip(".")) or {}
        values.update({prefix + cause: float(v) for cause, v in by_cause.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for phase in (status.get("scaling") or {}).get("phases") or []:
        if isinstance(phase.get("efficiency"), (int, float)) and "nodes" in phase:
            values[f"{SCALING_GAUGE[0]}{phase['nodes']}"] = float(phase["efficiency"])
    _PHASES.set(namespace, name, status.get("phase") or "Pending", values)


def forget(namespace: str, name: str) -> None:
    """A TrainingSpec was deleted: it no longer counts in any phase."""
    _PHASES.forget(namespace, name)


def serve(port: int, addr: str = "0.0.0.0"):
    """Expose the registry on http://<addr>:<port>/metrics from a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=REGISTRY)
