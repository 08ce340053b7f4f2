"""Run the operator: leader election first (kiln.control.leader), then kopf with kiln's handlers
(kiln.control.handlers, registered on import). `kiln operator` out of cluster, the image's entry point in one.
"""

from __future__ import annotations

import asyncio
import os

import kopf

from kiln.control import handlers, leader, metrics  # noqa: F401 (handlers: importing registers them with kopf)
from kiln.control.config import OperatorConfig
from kiln.control.health import serve_standby
from kiln.control.process import PROCESS


def run(namespaces: list[str] | None = None, kubeconfig: str | None = None,
        config: OperatorConfig | None = None, health: str | None = None, lease: str | None = None) -> None:
    """Run the operator until interrupted. health: e.g. http://0.0.0.0:8080/healthz (None: no endpoint).
    lease: `[NAMESPACE/]NAME` of the leader election Lease (kiln.control.leader.location)."""
    PROCESS.config = config or OperatorConfig.from_env()
    PROCESS.kubeconfig = kubeconfig
    PROCESS.namespaces = list(namespaces) if namespaces else None
    kube = PROCESS.kube()  # fail early, with a message, on missing credentials
    kopf.configure(verbose=False)  # INFO: one line per handled spec change, start and retry
    if PROCESS.config.metrics_port:
        metrics.serve(PROCESS.config.metrics_port)
    env = dict(os.environ)
    where = leader.location(lease or PROCESS.config.leader_lease, env, leader.sa_namespace(), namespaces)
    elector = leader.Elector(kube, *where, leader.identity(env))
    asyncio.run(_lead_then_operate(elector, namespaces, health))
    if elector.lost:
        raise SystemExit(f"kiln operator: lost {elector.where}; exiting so that a restart waits as a standby")


async def _lead_then_operate(elector: leader.Elector, namespaces: list[str] | None, health: str | None) -> None:
    # A standby answers /healthz (it is alive) but starts no watch until it holds the Lease.
    standby = await serve_standby(health) if health else None
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
