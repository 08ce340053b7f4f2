"""Kueue's view of a run: why its PyTorchJob waits, when it was admitted and with which flavor.

Kueue admits a queued job through a Workload it makes for it (owned by the job, labelled with the job's
uid): while the Workload waits, the job stays suspended (Kueue's webhook suspended it at creation), so no
pod exists. `queue_state(job, workload)` is pure: the Workload's conditions → one state for the run's
status (phase Queued, condition Queued, status.queue). `read_workload(kube, job)` is the one read, made
only for a job labelled with a queue; a cluster without Kueue (404) or an operator not allowed to read
Workloads (403) reads as no Workload, and the run's status says it waits for one.

With replica groups each group's PyTorchJob has a Workload of its own and Kueue admits each group alone:
kiln.control.replica_groups reads and folds them with the functions here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from kiln.api.spec import TOPOLOGY_DOMAINS_MAX

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"


@dataclass(frozen=True)
class QueueState:
    queue: str  # the LocalQueue
    admitted: bool
    reason: str  # Kueue's own: Admitted, Pending (QuotaReserved=False), Preempted, PodsReadyTimeout, ...
    message: str
    admitted_at: str | None = None
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = field(default=())
    topology_levels: tuple[str, ...] = field(default=())
    topology_domains: tuple[str, ...] = field(default=())  # each its level values joined by '/'
    waiting_groups: tuple[int, ...] | None = None  # replica groups: those not admitted (None: no groups)

    def as_status(self) -> dict:
        """status.queue: the queue, and once admitted, when, where and with which flavors (and topology
        domains, under a flavor with a Topology)."""
        out: dict = {"name": self.queue}
        if self.admitted:
            out |= {"admittedAt": self.admitted_at, "clusterQueue": self.cluster_queue, "flavors": list(self.flavors)}
            if self.topology_domains:
                out["topology"] = {"levels": list(self.topology_levels),
                                   "domains": list(self.topology_domains[:TOPOLOGY_DOMAINS_MAX])}
        if self.waiting_groups is not None:
            out["waitingGroups"] = list(self.waiting_groups)
        return {k: v for k, v in out.items() if v is not None}


def topology_domains(admission: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(levels, domains) of the Workload's topology assignments (Kueue v1beta2's compact form: per slice,
    each level's values as one `universal` value or `individual` roots with a common prefix and suffix)."""
    levels: tuple[str, ...] = ()
    domains: list[str] = []
    for psa in admission.get("podSetAssignments") or []:
        ta = psa.get("topologyAssignment") or {}
        levels = tuple(ta.get("levels") or levels)
        for piece in ta.get("slices") or []:
            count, columns = int(piece.get("domainCount") or 0), []
            for values in piece.get("valuesPerLevel") or []:
                if values.get("universal") is not None:
                    columns.append([values["universal"]] * count)
                else:
                    one = values.get("individual") or {}
                    columns.append([f"{one.get('prefix') or ''}{root}{one.get('suffix') or ''}"
                                    for root in one.get("roots") or []])
            domains += ["/".join(at) for at in zip(*columns)]
    return levels, tuple(domains)


def queue_name(job: dict | None) -> str | None:
    return ((job or {}).get("metadata") or {}).get("labels", {}).get(QUEUE_LABEL) or None


def held(job: dict | None) -> bool:
    """Whether the job is suspended (by Kueue until admission, or after an eviction)."""
    return bool((((job or {}).get("spec") or {}).get("runPolicy") or {}).get("suspend"))


def _conditions(workload: dict) -> dict[str, dict]:
    return {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}


def queue_state(job: dict | None, workload: dict | None) -> QueueState | None:
    """The run's place in Kueue (None: its job names no queue)."""
    queue = queue_name(job)
    if queue is None:
        return None
    if workload is None:
        return QueueState(queue, False, "NoWorkload",
                          f"waiting for Kueue to make a Workload for this run in LocalQueue {queue} (is Kueue installed, "
                          "and does the LocalQueue exist?)")
    conds = _conditions(workload)

    def true(ctype: str) -> bool:
        return conds.get(ctype, {}).get("status") == "True"

    if true("Admitted"):
        admission = (workload.get("status") or {}).get("admission") or {}
        flavors = tuple(sorted({f for psa in admission.get("podSetAssignments") or []
                                for f in (psa.get("flavors") or {}).values()}))
        cq = admission.get("clusterQueue")
        levels, domains = topology_domains(admission)
        return QueueState(queue, True, "Admitted", f"admitted by ClusterQueue {cq} (flavor {', '.join(flavors)})",
                          admitted_at=conds["Admitted"].get("lastTransitionTime"), cluster_queue=cq, flavors=flavors,
                          topology_levels=levels, topology_domains=domains)
    if true("Evicted"):  # preempted, or its pods were not all ready in time: requeued, waits again
        ev = conds["Evicted"]
        return QueueState(queue, False, ev.get("reason") or "Evicted", ev.get("message") or "evicted by Kueue")
    reserved = conds.get("QuotaReserved")
    if reserved and reserved.get("status") == "False":
        return QueueState(queue, False, reserved.get("reason") or "Pending", reserved.get("message") or "")
    # kiln's own reason (as NoWorkload): Kueue has made the Workload but said nothing about it yet
    return QueueState(queue, False, "WaitingForKueue", f"waiting for Kueue to consider it in LocalQueue {queue}")


def with_admitted_tolerations(desired: dict, live: dict | None) -> dict:
    """The PyTorchJob kiln is about to apply, keeping the tolerations Kueue added to the live job's pod
    templates when it admitted the run (its ResourceFlavor's `tolerations`).

    A pod template's tolerations are one atomic list to server-side apply: kiln's forced apply (a spec edit,
    the periodic resync, an elastic change) would replace Kueue's with kiln's own, and a pod the
    training-operator makes after that (a restart) could not go where Kueue placed the run. Only while the
    job is admitted: when Kueue suspends it again it restores the templates itself."""
    if live is None or not queue_name(live) or held(live) or \
            (live.get("metadata") or {}).get("name") != desired["metadata"]["name"]:
        return desired
    out = copy.deepcopy(desired)
    live_specs = (live.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    for rtype, replica in ((out.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items():
        pod = replica["template"]["spec"]
        mine = pod.get("tolerations") or []
        theirs = (((live_specs.get(rtype) or {}).get("template") or {}).get("spec") or {}).get("tolerations") or []
        if extra := [t for t in theirs if t not in mine]:
            pod["tolerations"] = mine + extra
    return out


def read_workload(kube, job: dict | None) -> dict | None:
    """The Workload Kueue made for `job` (None: none, no Kueue, or not allowed to read it)."""
    meta = (job or {}).get("metadata") or {}
    if not queue_name(job) or not meta.get("uid"):
        return None
    try:
        found = kube.custom.list_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, label_selector=f"{JOB_UID_LABEL}={meta['uid']}")
    except ApiException as err:
        if err.status in (403, 404):
            return None
        raise
    items = found.get("items") or []
    # a job's Workload is replaced when its pod sets change: the newest one is the job's now
    return max(items, key=lambda w: w["metadata"].get("creationTimestamp") or "") if items else None


def needs_read(job: dict | None, old_status: dict | None) -> bool:
    """Whether a status refresh should read the Workload: while Kueue holds the job, while the run has not
    left Pending/Queued, and once after each admission (to record when and where). A running admitted
    run costs no read."""
    if not queue_name(job):
        return False
    old = old_status or {}
    if held(job) or old.get("phase") in (None, "Pending", "Queued"):
        return True
    return not (old.get("queue") or {}).get("admittedAt")


def observe(kube, job: dict | None, old_status: dict | None) -> QueueState | None:
    """The run's place in Kueue for kiln.control.status.derive (None: nothing to read or change)."""
    return queue_state(job, read_workload(kube, job)) if needs_read(job, old_status) else None













# ---- what the run's ClusterQueue covers: a pod request it does not cover is never admitted ----

LOCAL_QUEUES, CLUSTER_QUEUES = "localqueues", "clusterqueues"
# on a run's PyTorchJob: the requests kiln left out when it first made the job, because the ClusterQueue did
# not cover them; kept by every later apply of that job (a changed pod set would make Kueue stop an admitted job)
LEFT_OUT_ANNOTATION = "kiln.dev/queue-left-out"


@dataclass(frozen=True)
class Coverage:
    """The resources the ClusterQueue behind a run's LocalQueue has quota for."""

    cluster_queue: str
    resources: frozenset[str]
    excluded_prefixes: tuple[str, ...] = ()  # Kueue's resources.excludeResourcePrefixes: ignored by Kueue

    def covers(self, resource: str) -> bool:
        return resource in self.resources or resource.startswith(self.excluded_prefixes)


def covered_resources(cluster_queue: dict) -> frozenset[str]:
    """Every resource name a ClusterQueue's resourceGroups cover."""
    groups = (cluster_queue.get("spec") or {}).get("resourceGroups") or []
    return frozenset(r for g in groups for r in (g.get("coveredResources") or []))


def read_coverage(kube, namespace: str, queue: str, excluded_prefixes: tuple[str, ...] = ()) -> Coverage | None:
    """The ClusterQueue's coverage through the LocalQueue `queue` (None: no such LocalQueue or ClusterQueue,
    no Kueue, or the operator may not read them; then kiln requests everything and Kueue says what it lacks)."""
    try:
        local = kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, LOCAL_QUEUES, queue)
        name = (local.get("spec") or {}).get("clusterQueue")
        if not name:
            return None
        cq = kube.custom.get_cluster_custom_object(GROUP, VERSION, CLUSTER_QUEUES, name)
    except ApiException as err:
        if err.status in (403, 404):
            return None
        raise
    return Coverage(name, covered_resources(cq), excluded_prefixes)


def left_out_of(job: dict | None) -> tuple[str, ...] | None:
    """The requests kiln left out of this live job (None: no job; then the plan decides from the queue)."""
    if job is None:
        return None
    raw = ((job.get("metadata") or {}).get("annotations") or {}).get(LEFT_OUT_ANNOTATION) or ""
    return tuple(r for r in raw.split(",") if r)


def observe_queue(kube, namespace: str, queue: str | None, jobs: list[dict],
                  excluded_prefixes: tuple[str, ...] = ()) -> tuple[Coverage | None, tuple[str, ...] | None]:
    """(Observed.queue_coverage, Observed.left_out) for a run: an admitted job keeps what was left out of it
    (no read); otherwise the ClusterQueue is read, so an admin's fix reaches a run that still waits."""
    if not queue:
        return None, None
    if admitted := [j for j in jobs if j is not None and not held(j)]:
        return None, left_out_of(admitted[0])
    return read_coverage(kube, namespace, queue, excluded_prefixes), None
