"""What this operator process remembers of each run, in one place, dropped by one `forget()`.

Memory only, and only a shortcut: a restarted operator starts empty and re-learns every run from the
apiserver (each run's first event after a start reconciles it, since kopf's diff base is kept here too; the
elastic loop's own state lives in the TrainingSpec's annotation, kiln.control.elastic_state).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

Key = tuple[str, str]  # (namespace, TrainingSpec name)


@dataclass
class Run:
    # Reconcile, status refresh and the elastic tick of one run never interleave: pod, job and spec events
    # arrive on different worker threads.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The TrainingSpec as this process last read it or its status patch returned it (kiln.control.sync).
    spec: dict | None = None
    # REST path → (digest of the body last applied there, time.monotonic() of that apply) (Kube.apply).
    applied: dict[str, tuple[str, float]] = field(default_factory=dict)
    # (uid, kopf's essence of the TrainingSpec) as this process last handled it: kopf's diff base
    # (kiln.control.kopf_settings.MemoryDiffBase), kept here instead of an annotation on the object.
    handled: tuple[str, dict] | None = None
    # resourceVersion of the PyTorchJob the status was last derived from: the watch's echo of it is skipped.
    derived_from: str | None = None
    # time.monotonic() of the last full reconcile (spec event or periodic resync) and of the next tick.
    reconciled_at: float = 0.0
    due: float | None = None
    ticking: bool = False


class Runs:
    """Thread-safe (namespace, name) → Run."""

    def __init__(self) -> None:
        self._runs: dict[Key, Run] = {}
        self._guard = threading.Lock()

    def __getitem__(self, key: Key) -> Run:
        with self._guard:
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = Run()
            return run

    def get(self, key: Key) -> Run | None:
        return self._runs.get(key)

    def items(self) -> list[tuple[Key, Run]]:
        with self._guard:
            return list(self._runs.items())

    def forget(self, key: Key) -> None:
        """The TrainingSpec is gone: drop everything remembered of it."""
        with self._guard:
            self._runs.pop(key, None)
