"""The elastic loop's I/O: nodes and pods as watched → kiln.control.elastic (pure) → apply, patch, post Events.

Called by the operator's periodic tick (kiln.control.ticks) every 15 s per TrainingSpec, with the nodes and
pods its watches hold (kopf indexes of `node_summary` and `gpu_holding`), and by tests directly (`listed`).
The operator's own elastic state (the node count it chose, when, and which nodes failed the job) lives in
the annotation `kiln.dev/elastic-state` of the TrainingSpec (kiln.control.elastic_state), so an operator
restart continues where it was; the decision and its reason are the `Elastic` condition in status and an
Event. Every request goes through kiln.control.kube.Kube.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kiln.api.spec import TrainingSpec
from kiln.api import hang as hang_rule
from kiln.control import elastic, failover, goodput, kueue, sync
from kiln.control.config import OperatorConfig
from kiln.control.elastic_state import ANNOTATION, avoided, encode, state_of  # noqa: F401 (state_of: for tests)
from kiln.control.kube import Kube, now
from kiln.control.names import RUN_LABEL
from kiln.control.parts import layout_of
from kiln.control.plan import Observed, plan
from kiln.control.requests import GPU
from kiln.control.job_state import job_condition
from kiln.control.status import Event, set_condition


@dataclass(frozen=True)
class Tuning:
    grace_s: float = 120.0  # NotReady this long → force-delete the job's pods there
    grow_cooldown_s: float = 300.0  # between a change and the next growth
    hang_factor: float = hang_rule.HANG_FACTOR  # no step for this many x p99 step time → restart
    hang_floor_s: float = hang_rule.HANG_FLOOR_S


def _time(ts: str | None) -> float | None:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else None


# What the elastic loop needs of the cluster, kept small: the operator's watches (kopf indexes,
# kiln.control.indexes) hold one of these per node and per GPU-holding pod, so a tick asks the apiserver
# nothing about nodes or pods and its cost does not grow with the cluster.

@dataclass(frozen=True)
class GpuHolding:
    """A pod placed on a node, not finished, that requests GPUs."""
    node: str
    run: tuple[str | None, str | None]  # (namespace, the kiln run label or None)
    gpus: int


def node_summary(node: dict) -> elastic.NodeView:
    """A Node as the elastic loop sees it, with all of its allocatable GPUs free (free_gpus subtracts)."""
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    is_ready = ready is not None and ready.get("status") == "True"
    return elastic.NodeView(
        name=meta["name"], ready=is_ready, labels=dict(meta.get("labels") or {}),
        gpus_free=int((status.get("allocatable") or {}).get(GPU, 0)),
        unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
        not_ready_since=None if is_ready or ready is None else _time(ready.get("lastTransitionTime")))


def gpu_holding(pod: dict) -> GpuHolding | None:
    """The GPUs a pod holds on its node (None: unplaced, finished, or no GPU requested)."""
    spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
    node = spec.get("nodeName")
    if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    gpus = sum(int(((c.get("resources") or {}).get("requests") or {}).get(GPU, 0))
               for c in spec.get("containers") or [])
    if not gpus:
        return None
    return GpuHolding(node, (meta.get("namespace"), (meta.get("labels") or {}).get(RUN_LABEL)), gpus)


def free_gpus(nodes: list[elastic.NodeView], held: list[GpuHolding], run: tuple[str, str]) -> list[elastic.NodeView]:
    """The nodes with the GPUs that pods other than this run's leave free."""
    used: dict[str, int] = {}
    for h in held:
        if h.run != run:
            used[h.node] = used.get(h.node, 0) + h.gpus
    return [replace(n, gpus_free=n.gpus_free - used.get(n.name, 0)) for n in nodes]


def node_views(nodes: list[dict], pods: list[dict], run: tuple[str, str]) -> list[elastic.NodeView]:
    """NodeViews with the GPUs that pods other than this run's leave free (from Node and Pod objects)."""
    return free_gpus([node_summary(n) for n in nodes], [h for p in pods if (h := gpu_holding(p))], run)


@dataclass(frozen=True)
class Seen:
    """The cluster as one tick of one run needs it."""
    nodes: list[elastic.NodeView]  # node_summary of every node
    held: list[GpuHolding]  # every GPU-holding pod the operator may see
    job: dict | None  # the run's PyTorchJob
    pods: list[dict]  # the run's pods: metadata.name and spec.nodeName are read


def listed(kube: Kube, namespace: str, name: str, watched: list[str] | None = None) -> Seen:
    """A Seen read from the apiserver (lists every node and pod: for tests and one-off use; the operator
    keeps the same from its watches). watched: the namespaces whose pods count (None: all)."""
    pods = kube.pods_in(watched)
    return Seen([node_summary(n) for n in kube.nodes()], [h for p in pods if (h := gpu_holding(p))],
                kube.job(namespace, name), kube.pods(namespace, name))


def runs(job: dict | None) -> bool:
    """Whether the elastic loop has a job to look after, from the watch's copy alone: not when there is none,
    it has finished, or it is suspended, by the training-operator's condition or already by its spec (a run
    created suspended, or held by Kueue, whose job the training-operator has not marked yet: in a burst of
    new runs that took longer than a run's first ticks, each of which read the TrainingSpec for nothing)."""
    if job is None or job_condition(job) in ("Succeeded", "Failed", "Suspended"):
        return False
    return not ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend")


def tick(kube: Kube, namespace: str, name: str, config: OperatorConfig, post, now_s: float | Callable[[], float],
         seen: Seen | Callable[[], Seen], tuning: Tuning = Tuning()) -> str:
    """One pass of the elastic loop for one run; returns a one-line summary.

    seen: nodes, GPU-holding pods, the run's job and pods, as the operator's watches hold them (or `listed`);
    given as a function, it is read again once the run's lock is held (sync.observed_now), so the tick decides
    from the view as it is then, not from one older than what another handler has just acted on; so is `now_s`
    (epoch seconds, or time.time): a time taken before the wait is older than the goodput ledger another
    handler may have written meanwhile, which would then price nothing up to this tick's status write.
    GPUs in use are counted from the pods the operator may watch: all of them cluster-wide; under a namespaced
    install only the watched namespaces' pods, so GPUs that other namespaces' pods hold look free
    (docs/security.md, item 2). The one request a tick of a running job makes is a GET of the TrainingSpec,
    whose annotation holds the loop's state; a run whose job is missing, suspended or finished costs none.
    """
    if not runs(sync.observed_now(seen).job):
        # decided from the watch's job alone: no request, no wait for the run's lock (a burst of new or
        # suspended runs ticks often before their jobs run)
        return f"{namespace}/{name}: not running"
    with kube.runs[(namespace, name)].lock:
        seen, now_s = sync.observed_now(seen), sync.observed_now(now_s)
        job = seen.job
        if not runs(job):
            return f"{namespace}/{name}: not running"
        body = kube.trainingspec(namespace, name)
        if body is None:
            return f"{namespace}/{name}: gone"
        try:
            doc = TrainingSpec.model_validate(body)
        except ValidationError:
            return f"{namespace}/{name}: invalid spec, left to reconcile"
        layout = layout_of(doc.spec)
        if not layout.elastic_nodes:  # replica groups: each group's PyTorchJob is of a fixed size and restarts alone
            return f"{namespace}/{name}: replica groups: no node-count elasticity, each group restarts alone"
        if doc.spec.suspend:
            return f"{namespace}/{name}: not running"
        state = state_of(body)
        views = free_gpus(seen.nodes, seen.held, (namespace, name))
        ours = seen.pods

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
        # GPU health (kiln.control.failover): a node whose GPUs degrade or fail is left at a commit
        gpu = failover.step(doc.spec, body.get("status") or {}, state, ours, views)
        avoid = avoided({**state, **gpu.state, "nodeFailures": failures})  # and the nodes left for their GPUs
        before = set(elastic.nodes_to_avoid(state.get("nodeFailures") or {}))
        for node in set(elastic.nodes_to_avoid(failures)) - before:  # (nodes left for their GPUs: GPUFailover)
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
        new_state.update(gpu.state)
        # a move restarts the run on purpose: the hang watch starts again once it reports from the new nodes
        new_state.update({"progress": {}} if new_state.get("gpuFailover") else
                         _hang_check(kube, body, doc, state, ours, now_s, tuning, post))
        cond = ("True", ("Shrink" if decision.nodes < current else "Grow") if decision.changed else
                ("WaitingForCapacity" if decision.reason.startswith("waiting") else "Steady"), decision.reason)
        if decision.changed or avoid != avoided(state):
            try:  # through the reconcile's own apply path: the same ownership check (sync.apply_plan)
                desired = plan(doc, Observed(applied=kube.applied_spec(namespace, name), job_active=True,
                                             nodes=decision.nodes, avoid_nodes=tuple(avoid),
                                             left_out=kueue.left_out_of(job)), config)
                done = sync.apply_plan(kube, desired.objects if desired.refused is None else [],
                                       {n: job for n in layout.job_names(name)}, layout.job_names(name),
                                       body["metadata"].get("uid"))
            except ApiException as err:  # reading the applied spec failed
                done = sync.Applied(("False", "ApplyFailed", f"{err.status} {err.reason}"), {})
            if done.refusal is not None:  # not recorded as done: the next tick decides (and tries) again
                cond = ("False", done.refusal[1], f"{decision.reason}; not applied: {done.refusal[2]}")
                new_state = {**new_state, "nodes": state.get("nodes"), "lastChange": state.get("lastChange"),
                             **{k: state.get(k) for k in gpu.state}}
                gpu = failover.Step(condition=gpu.condition if not gpu.move else None)
            else:
                if decision.changed:
                    post(body, Event("Normal", "Scaling", decision.reason))
                if gpu.move:  # the commit request: SIGTERM to every rank, which save one agreed step and exit
                    for p in ours:  # the training-operator recreates them under the new affinity
                        kube.delete_pod(namespace, p["metadata"]["name"])
        for pod in gpu.strays:
            kube.delete_pod(namespace, pod)
        for event in gpu.events:
            post(body, Event(*event))
        if new_state != state:
            kube.patch_annotations(namespace, name, {ANNOTATION: encode(new_state)})
        old = body.get("status") or {}
        conditions = set_condition(list(old.get("conditions") or []), "Elastic", *cond,
                                   now(), old.get("observedGeneration"))
        if gpu.condition is not None:
            conditions = set_condition(conditions, "GPUHealthy", *gpu.condition, now(), old.get("observedGeneration"))
        if conditions != (old.get("conditions") or []):
            created = goodput.epoch(body["metadata"].get("creationTimestamp") or now())
            resources = body["spec"].get("resources") or {}
            kube.patch_status(namespace, name, goodput.settled(
                old, {"conditions": conditions}, now_s, created, gpus_per_node=int(resources.get("gpusPerNode") or 0),
                price_per_gpu_hour=config.pricing.of(resources.get("gpuType")), currency=config.pricing.currency))
        return f"{namespace}/{name}: {decision.reason}"


def _hang_check(kube: Kube, body: dict, doc: TrainingSpec, state: dict, pods: list[dict], now_s: float,
                tuning: Tuning, post) -> dict:
    """Track the step trainer rank 0 reports; restart the job's pods when it stopped moving (with budget)."""
    namespace = body["metadata"]["namespace"]
    step = (body.get("status") or {}).get("step")
    prog = dict(state.get("progress") or {})
    if step is None or not pods:
        return {"progress": {}}  # nothing to watch yet (or no pods): the clock starts with the first report
    if step != prog.get("step"):
        recent = list(prog.get("recent") or [])
        if prog.get("step") is not None and step > prog["step"]:
            recent = (recent + [(now_s - prog["time"]) / (step - prog["step"])])[-20:]
        return {"progress": {"step": step, "time": now_s, "recent": recent}}
    why = hang_rule.hang(prog.get("recent") or [], prog["time"], now_s, factor=tuning.hang_factor,
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
