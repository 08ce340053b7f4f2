"""The elastic loop's I/O: read nodes and pods → kiln.control.elastic (pure) → apply, patch, post Events.

Called by the operator's periodic tick (kiln.control.handlers) every 15 s per TrainingSpec, and by tests
directly. The operator's own elastic state (the node count it chose, when, and which nodes failed the job)
lives in the annotation `kiln.dev/elastic-state` of the TrainingSpec (kiln.control.elastic_state), so an
operator restart continues where it was; the decision and its reason are the `Elastic` condition in status
and an Event. Every request goes through kiln.control.kube.Kube.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kiln.api.spec import TrainingSpec
from kiln.control import elastic
from kiln.control.config import OperatorConfig
from kiln.control.elastic_state import ANNOTATION, encode, state_of  # noqa: F401 (state_of: for tests)
from kiln.control.kube import Kube, now
from kiln.control.plan import GPU, RUN_LABEL, Observed, plan
from kiln.control.status import Event, job_condition, set_condition


@dataclass(frozen=True)
class Tuning:
    grace_s: float = 120.0  # NotReady this long → force-delete the job's pods there
    grow_cooldown_s: float = 300.0  # between a change and the next growth
    hang_factor: float = 10.0  # no step for this many x p99 step time → restart
    hang_floor_s: float = 60.0


def _time(ts: str | None) -> float | None:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else None


def node_views(nodes: list[dict], pods: list[dict], run: tuple[str, str]) -> list[elastic.NodeView]:
    """NodeViews with the GPUs that pods other than this run's leave free."""
    used: dict[str, int] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        meta = p.get("metadata") or {}
        ours = (meta.get("namespace"), (meta.get("labels") or {}).get(RUN_LABEL)) == run
        if not node or ours or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in (p.get("spec") or {}).get("containers") or []:
            used[node] = used.get(node, 0) + int(((c.get("resources") or {}).get("requests") or {}).get(GPU, 0))
    out = []
    for n in nodes:
        meta, status = n.get("metadata") or {}, n.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        is_ready = ready is not None and ready.get("status") == "True"
        out.append(elastic.NodeView(
            name=meta["name"], ready=is_ready, labels=meta.get("labels") or {},
            gpus_free=int((status.get("allocatable") or {}).get(GPU, 0)) - used.get(meta["name"], 0),
            unschedulable=bool((n.get("spec") or {}).get("unschedulable")),
            not_ready_since=None if is_ready or ready is None else _time(ready.get("lastTransitionTime"))))
    return out


def tick(kube: Kube, namespace: str, name: str, config: OperatorConfig, post, now_s: float,
         tuning: Tuning = Tuning(), watched: list[str] | None = None) -> str:
    """One pass of the elastic loop for one run; returns a one-line summary.

    watched: the namespaces the operator serves (None: all). GPUs in use are counted from the pods it may
    list: all of them cluster-wide; under a namespaced install only the watched namespaces' pods, so GPUs
    that other namespaces' pods hold look free (docs/security.md, item 2).
    """
    with kube.runs[(namespace, name)].lock:
        body = kube.trainingspec(namespace, name)
        if body is None:
            return f"{namespace}/{name}: gone"
        try:
            doc = TrainingSpec.model_validate(body)
        except ValidationError:
            return f"{namespace}/{name}: invalid spec, left to reconcile"
        job = kube.job(namespace, name)
        if doc.spec.suspend or job is None or job_condition(job) in ("Succeeded", "Failed", "Suspended"):
            return f"{namespace}/{name}: not running"
        state = state_of(body)
        all_pods = kube.pods_in(watched)
        views = node_views(kube.nodes(), all_pods, (namespace, name))
        ours = [p for p in all_pods if (p["metadata"].get("namespace"), (p["metadata"].get("labels") or {})
                                         .get(RUN_LABEL)) == (namespace, name)]

        # Pods stuck on dead nodes: free their place, remember the node.
        stuck = elastic.pods_to_force_delete(
            [elastic.PodView(p["metadata"]["name"], (p.get("spec") or {}).get("nodeName")) for p in ours],
            {v.name: v for v in views}, now_s, tuning.grace_s)
        failed_nodes = []
        for pod, reason in stuck:
            node = next(p["spec"].get("nodeName") for p in ours if p["metadata"]["name"] == pod)
            kube.delete_pod(namespace, pod, grace_period_seconds=0)
            post(body, Event("Warning", "PodForceDeleted", f"pod {pod}: {reason}; force-deleted"))
            failed_nodes.append(node)
        failures = elastic.record_node_failures(state.get("nodeFailures") or {}, failed_nodes)
        avoid = elastic.nodes_to_avoid(failures)
        for node in set(avoid) - set(elastic.nodes_to_avoid(state.get("nodeFailures") or {})):
            post(body, Event("Warning", "NodeAvoided", f"node {node} failed this job {failures[node]} times; "
                                                       "new pods avoid it"))

        workers = ((job.get("spec") or {}).get("pytorchReplicaSpecs") or {}).get("Worker") or {}
        current = int(workers.get("replicas") or doc.spec.resources.nodes)
        committed = ((body.get("status") or {}).get("lastCheckpoint") or {}).get("step") or 0
        decision = elastic.desired_nodes(doc.spec, views, current, committed_step=committed, avoid=avoid,
                                         now=now_s, last_change=state.get("lastChange"),
                                         grow_cooldown_s=tuning.grow_cooldown_s)
        new_state = {**state, "nodes": decision.nodes, "reason": decision.reason, "nodeFailures": failures,
                     "lastChange": now_s if decision.changed else state.get("lastChange")}
        new_state.update(_hang_check(kube, body, doc, state, ours, now_s, tuning, post))
        cond = ("True", ("Shrink" if decision.nodes < current else "Grow") if decision.changed else
                ("WaitingForCapacity" if decision.reason.startswith("waiting") else "Steady"), decision.reason)
        if decision.changed or avoid != elastic.nodes_to_avoid(state.get("nodeFailures") or {}):
            try:
                applied = kube.applied_spec(namespace, name)
                desired = plan(doc, Observed(applied=applied, job_active=True, nodes=decision.nodes,
                                             avoid_nodes=tuple(avoid)), config)
                for obj in desired.objects if desired.refused is None else ():
                    kube.apply(obj)
            except ApiException as err:  # not recorded as done: the next tick decides (and tries) again
                cond = ("False", "ApplyFailed", f"{decision.reason}; not applied: {err.status} {err.reason}")
                new_state = {**new_state, "nodes": state.get("nodes"), "lastChange": state.get("lastChange")}
            else:
                if decision.changed:
                    post(body, Event("Normal", "Scaling", decision.reason))
        if new_state != state:
            kube.patch_annotations(namespace, name, {ANNOTATION: encode(new_state)})
        old = body.get("status") or {}
        conditions = set_condition(list(old.get("conditions") or []), "Elastic", *cond,
                                   now(), old.get("observedGeneration"))
        if conditions != (old.get("conditions") or []):
            kube.patch_status(namespace, name, {"conditions": conditions})
        return f"{namespace}/{name}: {decision.reason}"


def _hang_check(kube: Kube, body: dict, doc: TrainingSpec, state: dict, pods: list[dict], now_s: float,
                tuning: Tuning, post) -> dict:
    """Track the step trainer rank 0 reports; restart the job's pods when it stopped moving (with budget)."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    step = (body.get("status") or {}).get("step")
    prog = dict(state.get("progress") or {})
    if step is None or not pods:
        return {"progress": {}}  # nothing to watch yet (or no pods): the clock starts with the first report
    if step != prog.get("step"):
        recent = list(prog.get("recent") or [])
        if prog.get("step") is not None and step > prog["step"]:
            recent = (recent + [(now_s - prog["time"]) / (step - prog["step"])])[-20:]
        return {"progress": {"step": step, "time": now_s, "recent": recent}}
    why = elastic.hang(prog.get("recent") or [], prog["time"], now_s, factor=tuning.hang_factor,
                       floor_s=tuning.hang_floor_s, min_samples=2)
    if why is None:
        return {}
    restarts = int(state.get("restarts") or 0)
    verdict = elastic.restart_decision(restarts, doc.spec.elastic.max_restarts, state.get("lastRestart"), now_s,
                                       why)
    if verdict.action == "restart":
        for p in pods:  # the training-operator recreates them; the trainers resume from the last commit
            kube.delete_pod(namespace, p["metadata"]["name"])
        post(body, Event("Warning", "HangDetected", verdict.reason))
        return {"restarts": restarts + 1, "lastRestart": now_s,
                "progress": {**prog, "time": now_s}}  # the restarted job gets a fresh window
    if verdict.action == "fail" and not state.get("budgetSpent"):
        post(body, Event("Warning", "RestartBudgetSpent", verdict.reason))
        return {"budgetSpent": True}
    return {}
