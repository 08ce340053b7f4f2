"""The operator process's singletons: its config, the Kube client (which holds every run's state, kube.runs),
kopf's live indexes and context (for the ticks), the watched namespaces and the tick task.

Set by kiln.control.serve.run; read by the handlers (kiln.control.handlers, kiln.control.dispatch) and the
periodic tick (kiln.control.ticks). One instance, PROCESS, per operator process.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass

import kopf

from kiln.control.config import OperatorConfig
from kiln.control.indexes import Indexes
from kiln.control.kube import Kube, api_client
from kiln.control.status import Event

# Threads running the handlers (kopf's executor). A reconcile spends most of its time waiting for the
# apiserver, so a burst of new runs drains faster with many in flight; each thread keeps its connection.
WORKERS = 32
TICK_WORKERS = 8  # threads for the periodic ticks (kiln.control.ticks), apart from the handlers'


@dataclass
class Process:
    config: OperatorConfig | None = None
    kubeconfig: str | None = None
    namespaces: list[str] | None = None  # None: all
    indexes: Indexes | None = None  # kopf's live ones, learnt from the first TrainingSpec event
    kopf_context: contextvars.Context | None = None  # what kopf.event needs, for the ticks' threads
    ticks: asyncio.Task | None = None
    _kube: Kube | None = None

    def kube(self) -> Kube:
        if self._kube is None:
            if self.config is None:
                self.config = OperatorConfig.from_env()
            self._kube = Kube(api_client(self.kubeconfig, connections=WORKERS + TICK_WORKERS),
                              field_manager=self.config.field_manager, resync_seconds=self.config.resync_seconds)
        return self._kube


PROCESS = Process()


def post(body: dict, event: Event) -> None:
    """Post an Event on the TrainingSpec (kopf's queue: from a handler, or a tick in a copy of its context)."""
    kopf.event(body, type=event.type, reason=event.reason, message=event.message)
