"""Leader election: exactly one operator acts, through one coordination.k8s.io Lease.

A second operator (a rolling update, a partitioned node, `kiln operator` on a laptop) waits as a standby:
it starts no watch and handles nothing until the Lease is free. The leader renews the Lease every
`renew_s`; when it cannot for `deadline_s` (shorter than the Lease's duration, so it stops before anyone
else may start) it stops acting and exits non-zero, and its pod restarts as a standby. On a clean stop it
releases the Lease, so a standby takes over within `retry_s`; after a crash, within `duration_s + retry_s`.

Expiry is judged on the standby's own monotonic clock (how long the record it sees has not changed), never
by comparing the leader's renewTime with this machine's wall clock, so clock skew between them does not
matter. `claim` is pure; `Elector` does the I/O through Kube.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes.client.exceptions import ApiException

from kiln.control.kube import Kube
from kiln.errors import KilnError

DEFAULT_NAME = "kiln-operator"
DEFAULT_NAMESPACE = "kiln-system"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

_log = logging.getLogger("kiln.leader")


@dataclass(frozen=True)
class Timing:
    duration_s: int = 15  # a Lease whose record has not changed for this long is free
    deadline_s: float = 10.0  # the leader stops acting after failing to renew for this long
    renew_s: float = 2.0  # the leader renews this often
    retry_s: float = 2.0  # a standby looks this often


def location(value: str | None, env: dict[str, str], sa_namespace: str | None,
             namespaces: list[str] | None) -> tuple[str, str]:
    """(namespace, name) of the Lease from `[NAMESPACE/]NAME` (--leader-lease or KILN_LEADER_LEASE).

    Without a namespace: the pod's (POD_NAMESPACE, or its ServiceAccount's), else the first watched
    namespace, else kiln-system. Operators that must exclude each other must name the same Lease; operators
    of disjoint namespaced installs name different ones.
    """
    ns, _, name = (value or "").rpartition("/")
    ns = ns or env.get("POD_NAMESPACE") or sa_namespace or (namespaces[0] if namespaces else DEFAULT_NAMESPACE)
    return ns, name or DEFAULT_NAME


def identity(env: dict[str, str]) -> str:
    """Who holds the Lease: the pod's name (POD_ID), else host, pid and a random suffix (out of cluster)."""
    return env.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _micro(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # metav1.MicroTime


def record(lease: dict | None) -> tuple | None:
    """What changes whenever its holder renews it (a standby times its expiry by this)."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    return spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions")


def claim(lease: dict | None, namespace: str, name: str, me: str, unchanged_for_s: float, wall: datetime,
          timing: Timing = Timing()) -> dict | None:
    """The Lease to write so that `me` holds it (create when `lease` is None, else replace at its
    resourceVersion), or None: someone else holds it and renewed it less than its duration ago.

    unchanged_for_s: how long this process has seen the very same record (0 when it just changed)."""
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or None
    duration = spec.get("leaseDurationSeconds") or timing.duration_s
    if holder not in (None, me) and unchanged_for_s <= duration:
        return None
    mine = holder == me
    meta = {"name": name, "namespace": namespace}
    if lease is not None:
        meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
    transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine or lease is None else 1)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": me, "leaseDurationSeconds": int(timing.duration_s),
                     "acquireTime": spec.get("acquireTime") if mine and spec.get("acquireTime") else _micro(wall),
                     "renewTime": _micro(wall), "leaseTransitions": transitions}}


def released(lease: dict, me: str) -> dict | None:
    """The Lease with no holder (a standby takes it at once), or None when `me` does not hold it."""
    spec = lease.get("spec") or {}
    if spec.get("holderIdentity") != me:
        return None
    return {**lease, "spec": {**spec, "holderIdentity": None, "leaseDurationSeconds": 1}}


class Elector:
    """One process's side of the election (asyncio; each request runs in a thread)."""

    def __init__(self, kube: Kube, namespace: str, name: str, me: str, timing: Timing = Timing()):
        self.kube, self.namespace, self.name, self.me, self.timing = kube, namespace, name, me, timing
        self._seen: tuple[tuple | None, float] = (None, time.monotonic())
        self.lost = False

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    async def _try(self) -> bool:
        """One attempt to take or renew the Lease; True when this process holds it now."""
        lease = await asyncio.to_thread(self.kube.lease, self.namespace, self.name)
        rec, now = record(lease), time.monotonic()
        if rec != self._seen[0]:
            self._seen = (rec, now)
        body = claim(lease, self.namespace, self.name, self.me, now - self._seen[1], datetime.now(timezone.utc),
                     self.timing)
        if body is None:
            return False
        try:
            if lease is None:
                await asyncio.to_thread(self.kube.create_lease, self.namespace, body)
            else:
                await asyncio.to_thread(self.kube.replace_lease, self.namespace, body)
        except ApiException as err:
            if err.status == 409:  # someone else wrote it first: look again next time
                return False
            if err.status == 404 and lease is None:  # creating in a namespace that does not exist: never works
                raise KilnError(
                    f"cannot create the leader election {self.where}: namespace {self.namespace} does not exist; "
                    f"create it (kubectl create namespace {self.namespace}) or name a Lease in a namespace that "
                    f"exists with --leader-lease NAMESPACE/NAME (or KILN_LEADER_LEASE)") from None
            raise
        return True

    async def acquire(self) -> None:
        """Return once this process holds the Lease (a standby waits here)."""
        waiting = False
        while True:
            try:
                if await self._try():
                    _log.warning("kiln operator %s: leading (%s)", self.me, self.where)
                    return
                if not waiting:
                    holder = (self._seen[0] or (None,))[0]
                    _log.warning("kiln operator %s: standby, %s is held by %s", self.me, self.where, holder)
                    waiting = True
            except ApiException as err:
                _log.warning("kiln operator %s: %s: %s %s; trying again", self.me, self.where, err.status, err.reason)
            await asyncio.sleep(self.timing.retry_s)

    async def keep(self, on_lost) -> None:
        """Renew until cancelled; call on_lost() (and stop) once renewing failed for deadline_s."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.timing.renew_s)
            try:
                ok = await self._try()
            except ApiException as err:
                ok = False
                _log.warning("kiln operator %s: renewing %s failed: %s %s", self.me, self.where, err.status, err.reason)
            except Exception:  # noqa: BLE001 - a connection error is a failed renewal, not a crash
                ok = False
                _log.exception("kiln operator %s: renewing %s failed", self.me, self.where)
            if ok:
                last_ok = time.monotonic()
                continue
            taken = (self._seen[0] or (None,))[0] not in (None, self.me)  # it expired for someone else
            if taken or time.monotonic() - last_ok >= self.timing.deadline_s:
                self.lost = True
                _log.error("kiln operator %s: lost %s; stopping", self.me, self.where)
                on_lost()
                return

    async def release(self) -> None:
        """Give the Lease up (on a clean stop), so a standby takes over within retry_s."""
        try:
            lease = await asyncio.to_thread(self.kube.lease, self.namespace, self.name)
            body = released(lease, self.me) if lease else None
            if body is not None:
                await asyncio.to_thread(self.kube.replace_lease, self.namespace, body)
                _log.warning("kiln operator %s: released %s", self.me, self.where)
        except Exception:  # noqa: BLE001 - the Lease then expires by itself
            _log.exception("kiln operator %s: releasing %s failed", self.me, self.where)


def sa_namespace() -> str | None:
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None
