"""The TrainingSpec's status from what the cluster shows: PyTorchJob conditions + pods → phase, conditions.

Pure: `derive(...)` takes plain dicts (as the apiserver returns them) and the time to stamp, and returns
the status fields the operator owns plus the Events to post. Progress fields (step, progress,
etaSeconds, tokensPerSecond, mfu, lastCheckpoint, trainerTime) belong to trainer rank 0
(kiln.trainer.observe.status_report) and are never written here: the status is merge-patched, and a value
derived from a step read earlier could overwrite a newer one the trainer wrote meanwhile. goodput and
goodputDetail are the operator's: it sees the time no trainer runs (kiln.control.goodput).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.api.contract import CONDITION_TYPES
from kiln.control import goodput, kueue, replica_groups, scaling
from kiln.control.config import Pricing
from kiln.control.job_state import job_condition, running_pods

# Container waiting reasons a user must act on (wrong image name, missing Secret or key, ...).
USER_ERRORS = {
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "InvalidImage",
    "CreateContainerConfigError": "ContainerConfigError",  # e.g. the credentials Secret or a key is missing
}

PHASE_EVENT_TYPE = {"Failed": "Warning", "Restarting": "Warning"}


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Derived:
    status: dict[str, Any]  # merge-patch for the status subresource (operator-owned fields)
    events: list[Event] = field(default_factory=list)













def pods_to_stop(job: dict | None, pods: list[dict]) -> list[str]:
    """The pods to delete because their run failed while they still run (or wait to): a failed job's
    surviving workers would otherwise hold their GPUs until their rendezvous times out. Pods that have
    stopped stay, with their logs."""
    if job_condition(job) != "Failed":
        return []
    return sorted(p["metadata"]["name"] for p in pods
                  if (p.get("status") or {}).get("phase") in ("Pending", "Running")
                  and not p["metadata"].get("deletionTimestamp"))


def _job_message(job: dict | None, ctype: str) -> str:
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c.get("message") or ""
    return ""




def unschedulable(pods: list[dict]) -> str | None:
    for p in pods:
        for c in (p.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return f"pod {p['metadata']['name']}: {c.get('message', 'cannot be scheduled')}"
    return None


def container_errors(pods: list[dict]) -> list[tuple[str, str]]:
    found = []
    for p in pods:
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in USER_ERRORS:
                found.append((USER_ERRORS[reason],
                              f"pod {p['metadata']['name']}: {reason}: {waiting.get('message', '')}".strip()))
    return found


def phase_of(spec: dict, job: dict | None, pods: list[dict]) -> str:
    state = job_condition(job)
    if state in ("Succeeded", "Failed"):
        return state
    if spec.get("suspend"):
        return "Suspended"
    if kueue.queue_name(job) and (state == "Suspended" or kueue.held(job)):
        return "Queued"  # Kueue holds it: not admitted yet, or evicted (preempted) and waiting again
    if state == "Suspended":  # suspended by someone else
        return "Pending"
    if state == "Restarting":
        return "Restarting"
    if state == "Running":
        desired = (((job or {}).get("spec") or {}).get("pytorchReplicaSpecs") or {}).get("Worker", {}).get("replicas")
        running = running_pods(pods)
        if desired is not None and running != desired and running > 0:
            return "Scaling"
        return "Running"
    return "Pending"


def set_condition(conditions: list[dict], ctype: str, status: str, reason: str, message: str,
                  now: str, generation: int | None) -> list[dict]:
    """metav1.Condition semantics: lastTransitionTime changes only when status does."""
    if ctype not in CONDITION_TYPES:  # the types are a contract with users' tooling (kiln.api.contract)
        raise ValueError(f"condition type {ctype!r} is not one of kiln.api.contract.CONDITION_TYPES")
    out = [c for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    when = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": ctype, "status": status, "reason": reason, "message": message[:32768],
            "lastTransitionTime": when}
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    return sorted(out, key=lambda c: c["type"])


def gang(spec: dict) -> tuple[str, str, str]:
    """Condition Gang: whether the run's pods start all together or not at all, and through what (docs/scheduling.md
    "All or nothing"). From the spec as stored: a reconcile writes it with SpecAccepted."""
    sched = spec.get("scheduling") or {}
    if sched.get("queue"):
        where = ("against the ClusterQueue's quota and, with scheduling.topology's Topology flavor, the nodes' free "
                 "capacity" if sched.get("topology") else "against the ClusterQueue's quota only: without a "
                 "Topology flavor, pods outside Kueue holding the nodes can still leave some pods Pending")
        return ("True", "KueueAdmission", f"Kueue admits the run's whole pod set (each replica group's) at once, "
                f"{where}; no pod exists before admission")
    if sched.get("gang", True):
        return ("False", "NoGangScheduler", "scheduling.gang sets the PyTorchJob's schedulingPolicy.minAvailable, "
                "which only a gang scheduler reads (Volcano, scheduler-plugins coscheduling); the pods go to the "
                "default kube-scheduler, which places them one by one, so a run that does not fit can start some "
                "pods and hold their GPUs; set scheduling.queue for an all-or-nothing start")
    return ("False", "Disabled", "scheduling.gang is false and no queue is set: the pods are placed one by one")


def derive(ts: dict, job: dict | None, pods: list[dict], now: str,
           accepted: tuple[str, str, str] | None = None, queue: kueue.QueueState | None = None,
           group_jobs: list[dict | None] | None = None,
           group_queues: list[kueue.QueueState | None] | None = None, pricing: Pricing = Pricing()) -> Derived:
    """Status and Events for one TrainingSpec.

    job: the run's PyTorchJob (None: none), or with replica groups `combined_job(group_jobs)`; group_jobs:
    the run's PyTorchJobs, one per replica group in group order (None: the run has no replica groups).

    accepted: the SpecAccepted condition (status, reason, message) from the last reconcile: False when the
    operator applied nothing (a change the running job cannot absorb, a missing Secret); None keeps the
    condition as it is (status refreshes triggered by the job or its pods).
    queue: the run's place in Kueue (kiln.control.kueue) when it was read; None keeps condition Queued and
    status.queue as they are. group_queues: with replica groups, each group's place instead (observe_groups;
    None: none read), folded into the run's by kiln.control.replica_groups.fold. pricing: the price of the run's GPU type,
    for status.cost.
    """
    spec, old = ts.get("spec") or {}, ts.get("status") or {}
    # the generation acted on: the current one after a reconcile, else what the last reconcile saw
    gen = (ts.get("metadata") or {}).get("generation") if accepted is not None else old.get("observedGeneration")
    old_phase = old.get("phase")
    phase = phase_of(spec, job, pods)
    conditions = list(old.get("conditions") or [])
    events: list[Event] = []
    groups = replica_groups.fold(group_jobs, group_queues, pods, old)  # the layout part's own status
    queue = groups.queue if groups.queue_read else queue

    if accepted is not None:
        if accepted[0] == "False" and not _same(old, "SpecAccepted", *accepted):
            events.append(Event("Warning", accepted[1], accepted[2]))
        conditions = set_condition(conditions, "SpecAccepted", *accepted, now, gen)
        conditions = set_condition(conditions, "Gang", *gang(spec), now, gen)

    why_pending = unschedulable(pods)
    if why_pending:
        conditions = set_condition(conditions, "PodsScheduled", "False", "Unschedulable", why_pending, now, gen)
        if not _same(old, "PodsScheduled", "False", "Unschedulable", why_pending):
            events.append(Event("Warning", "Unschedulable", why_pending))
    elif pods:
        conditions = set_condition(conditions, "PodsScheduled", "True", "Scheduled", "every pod is bound to a node",
                                   now, gen)
    for reason, message in container_errors(pods):
        if not _same(old, "PodsReady", "False", reason, message):
            events.append(Event("Warning", reason, message))
        conditions = set_condition(conditions, "PodsReady", "False", reason, message, now, gen)
        break
    else:
        if pods and running_pods(pods) == len(pods):
            conditions = set_condition(conditions, "PodsReady", "True", "Running", "every pod is running", now, gen)

    if queue is not None:  # Queued=True with Kueue's reason while it waits; False once admitted
        # (with replica groups, once any group is: reason GroupsWaiting while others still wait)
        waiting = ("False", queue.reason, queue.message) if queue.admitted else ("True", queue.reason, queue.message)
        if (not queue.admitted or queue.waiting_groups) and not _same(old, "Queued", *waiting):
            events.append(Event("Normal", "Queued", f"{queue.reason}: {queue.message}"))
        conditions = set_condition(conditions, "Queued", *waiting, now, gen)

    job_msg = _job_message(job, job_condition(job) or "")
    for ctype in ("Running", "Suspended", "Succeeded", "Failed"):
        active = phase == ctype or (ctype == "Running" and phase == "Scaling")
        # Suspended is the spec's (phase_of), known when the reconcile writes it: the training-operator's
        # "is suspended" arriving later would cost every suspended new run a second status write
        says_job = active and job_msg and ctype != "Suspended"
        conditions = set_condition(conditions, ctype, "True" if active else "False", phase,
                                   job_msg if says_job else f"phase {phase}", now, gen)

    if phase != old_phase:
        message = f"phase {old_phase or 'none'} → {phase}" + (f": {job_msg}" if job_msg else "")
        events.append(Event(PHASE_EVENT_TYPE.get(phase, "Normal"), phase, message))

    status: dict[str, Any] = {
        "phase": phase,
        "nodes": running_pods(pods),
        "conditions": conditions,
        "observedGeneration": gen,
        "restarts": (old.get("restarts") or 0) + (1 if phase == "Restarting" and old_phase != "Restarting" else 0),
    }
    if gen is None:
        status.pop("observedGeneration")
    if queue is not None:
        status["queue"] = queue.as_status()
    status.update(groups.fields)
    events += [Event(*event) for event in groups.events]
    # the phase in status held until now: it prices the time since the last refresh
    created = goodput.epoch((ts.get("metadata") or {}).get("creationTimestamp") or now)
    ledger = goodput.Ledger.from_status(old, created)
    resources = spec.get("resources") or {}
    gpus = goodput.gpus_held(old, int(resources.get("gpusPerNode") or 0))
    ledger = goodput.observe(ledger, goodput.epoch(now), goodput.held(old), goodput.counters(old), gpus)
    status.update(ledger.as_status(), cost=goodput.cost(ledger, pricing.of(resources.get("gpuType")), pricing.currency))
    folded = scaling.fold(old.get("scaling"), nodes=old.get("nodes"), per_node=scaling.workers_per_node(resources),
                          step=old.get("step"), tokens_per_second=old.get("tokensPerSecond"))
    if folded:
        status["scaling"] = folded
    return Derived(status=status, events=events)


def same_condition(old_status: dict, ctype: str, status: str, reason: str, message: str) -> bool:
    """Whether the status holds exactly this condition already (its Event was posted then)."""
    return _same(old_status, ctype, status, reason, message)


def _same(old_status: dict, ctype: str, status: str, reason: str, message: str) -> bool:
    for c in old_status.get("conditions") or []:
        if c.get("type") == ctype:
            return c.get("status") == status and c.get("reason") == reason and c.get("message") == message
    return False


GOODPUT_FIELDS = ("goodput", "goodputDetail", "cost", "scaling")  # they move with the clock and the reports
# The ledger moves with the clock, so every refresh would differ in it. Alone it is written when the stored
# one is this old (the operator's 15 s tick, kiln.control.ticks, refreshes every run); with any other
# change (phase, conditions, nodes, restarts) it goes along at once. Skipping a write loses nothing: the next
# one attributes the whole interval. Each write of a TrainingSpec costs the apiserver 12-15 ms of CPU (its
# schema and CEL rules), so the ledger alone is written once a minute, not every tick.
GOODPUT_REFRESH_S = 60.0


def changed(old_status: dict, new_fields: dict, goodput_refresh_s: float = GOODPUT_REFRESH_S) -> bool:
    """Whether patching new_fields is worth a write (so a quiet cluster, or a burst of pod events, sees
    no writes that only move the goodput ledger by a few seconds)."""
    if any(old_status.get(k) != v for k, v in new_fields.items() if k not in GOODPUT_FIELDS):
        return True
    if all(old_status.get(k) == new_fields[k] for k in GOODPUT_FIELDS if k in new_fields):
        return False
    old_at = (old_status.get("goodputDetail") or {}).get("observedAt")
    new_at = (new_fields.get("goodputDetail") or {}).get("observedAt")
    if not old_at or not new_at:
        return True
    return goodput.epoch(new_at) - goodput.epoch(old_at) >= goodput_refresh_s
