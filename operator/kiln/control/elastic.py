"""Elastic and fault-recovery decisions of the operator. Pure: plain values in, decisions out; no I/O, no clock.

The handlers gather what the cluster shows (nodes, pods, the trainer's reported step and step times),
call these functions with the time `now` (seconds), and apply what they return:

- `desired_nodes`: the worker count, within [minNodes, maxNodes], in whole data-parallel groups, as many
  as the free matching GPU nodes allow, following the phase plan by the last *committed* step; a run in a
  Kueue queue starts at `start_nodes` and keeps the count Kueue admitted.
- `pods_to_force_delete`: pods stuck on NotReady/unreachable nodes past a grace period.
- `record_node_failures` / `nodes_to_avoid` / `avoid_affinity`: a node that failed a job twice is avoided.
- the hang rule (no step progress for N x the recent p99 step time) is kiln.api.hang's, shared with the trainer.
- `restart_decision`: the restart budget (elastic.maxRestarts) with exponential backoff.
- `suspend_phase`: where a suspend/resume handshake stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from kiln.api import layout
from kiln.api.spec import TrainingSpecSpec

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_LABEL = "kubernetes.io/hostname"


# ---- inputs (what the handlers observed) --------------------------------------------------------------


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    # nvidia.com/gpu allocatable minus what pods *other than this job's* request (this job's own count as free)
    gpus_free: int = 0
    unschedulable: bool = False  # cordoned
    not_ready_since: float | None = None  # when Ready turned False/Unknown (None while ready)


@dataclass(frozen=True)
class PodView:
    name: str
    node: str | None  # spec.nodeName; None while unscheduled
    deleting: bool = False  # has a deletionTimestamp


@dataclass(frozen=True)
class Decision:
    nodes: int
    reason: str
    changed: bool = False


# ---- whole data-parallel groups ------------------------------------------------------------------------


# One copy of the arithmetic, shared with kiln validate and the trainer: a count chosen here is one the
# trainer starts at (whole tensor x pipeline groups, the global batch kept, replicate and pipeline microbatches
# fitting).
bounds = layout.node_bounds
valid_node_count = layout.runnable
valid_node_counts = layout.runnable_node_counts


def _largest_valid_at_most(spec: TrainingSpecSpec, n: int) -> int | None:
    return max((c for c in valid_node_counts(spec) if c <= n), default=None)


def start_nodes(spec: TrainingSpecSpec) -> int:
    """The worker count a run's job is created with: resources.nodes, or for a run in a Kueue queue the
    smallest runnable count from minNodes up, which its Workload asks Kueue for (docs/scheduling.md)."""
    if not spec.scheduling.queue:
        return spec.resources.nodes
    return min(valid_node_counts(spec) or [bounds(spec)[0]])


# ---- phase plan ------------------------------------------------------------------------------------------


def plan_target(spec: TrainingSpecSpec, committed_step: int) -> int | None:
    """Nodes the phase plan asks for once `committed_step` is committed; None without a plan.

    The phase is chosen by the last *committed* checkpoint step, not the live step: the switch happens
    only after the trainer committed the boundary step (it saves at every untilStep, see plan_boundaries),
    so the restart that changes the world size loses nothing.
    """
    for entry in spec.elastic.plan:
        if entry.until_step is None or committed_step < entry.until_step:
            return entry.nodes
    return spec.elastic.plan[-1].nodes if spec.elastic.plan else None


def plan_boundaries(spec: TrainingSpecSpec) -> list[int]:
    """Steps at which the trainer must commit a checkpoint so a phase switch loses nothing."""
    return sorted(e.until_step for e in spec.elastic.plan if e.until_step is not None)


# ---- capacity and the decision -----------------------------------------------------------------------------


def node_matches(spec: TrainingSpecSpec, node: NodeView) -> bool:
    """Labels fit gpuType and nodeSelector (the same selector plan() renders)."""
    r = spec.resources
    want = dict(r.node_selector)
    if r.gpu_type:
        want[GPU_PRODUCT_LABEL] = r.gpu_type
    return all(node.labels.get(k) == v for k, v in want.items())


def placeable_nodes(spec: TrainingSpecSpec, nodes: Iterable[NodeView], avoid: Iterable[str] = ()) -> list[str]:
    """Nodes that can host one worker now: ready, schedulable, matching, enough free GPUs, not avoided."""
    avoid = set(avoid)
    need = spec.resources.gpus_per_node
    return sorted(n.name for n in nodes
                  if n.ready and not n.unschedulable and n.name not in avoid
                  and node_matches(spec, n) and n.gpus_free >= need)


def desired_nodes(spec: TrainingSpecSpec, nodes: Iterable[NodeView], current: int, *, committed_step: int = 0,
                  avoid: Iterable[str] = (), now: float = 0.0, last_change: float | None = None,
                  grow_cooldown_s: float = 300.0) -> Decision:
    """The worker count to run with and why.

    Shrinks at once when capacity is gone (the job cannot run on vanished nodes); grows only after
    `grow_cooldown_s` since the last change (each change restarts the workers, so flapping costs goodput).
    Never leaves [minNodes, maxNodes]; always a count that keeps whole tensor x pipeline groups and the
    global batch. When even minNodes does not fit, it stays at (at least) minNodes and says it waits.

    A run in a Kueue queue keeps its count: Kueue admits a PyTorchJob as one Workload of its replica count,
    and any other count makes Kueue stop the whole job and queue a new Workload (Kueue v0.17: elastic
    Workloads do not cover PyTorchJob), so growth would never start a pod beside the admitted ones.
    """
    if spec.scheduling.queue:
        return Decision(current, f"queued: keeps the {current} node(s) its Kueue Workload asked for; a queued "
                                 "run does not grow or shrink (another size would stop it and queue it again)")
    lo, hi = bounds(spec)
    capacity = len(placeable_nodes(spec, nodes, avoid))
    target = plan_target(spec, committed_step)
    goal = hi if target is None else max(lo, min(target, hi))
    goal_valid = _largest_valid_at_most(spec, goal)
    floor = min(valid_node_counts(spec) or [lo])
    if goal_valid is None:  # cannot happen for a spec the rules accepted; stay where we are
        return Decision(current, f"no node count in [{lo}, {hi}] keeps whole data-parallel groups")
    fit = _largest_valid_at_most(spec, min(goal_valid, capacity))
    why_goal = f"phase plan asks for {target} at committed step {committed_step}" if target is not None \
        else f"maxNodes is {hi}"

    if fit is None:  # even minNodes does not fit: run at the minimum, its pods wait Pending for capacity
        n = floor
        return Decision(n, f"waiting for capacity: {capacity} matching node(s) with {spec.resources.gpus_per_node} "
                           f"free GPU(s), need at least {floor} (minNodes {lo})", n != current)
    if fit < current:
        reason = (f"shrink {current} → {fit}: {why_goal}" if fit == goal_valid
                  else f"shrink {current} → {fit}: only {capacity} matching node(s) available")
        return Decision(fit, reason, True)
    if fit > current:
        if last_change is not None and now - last_change < grow_cooldown_s:
            return Decision(current, f"hold at {current}: {fit} would fit, growth waits "
                                     f"{grow_cooldown_s - (now - last_change):.0f}s more (cooldown)")
        return Decision(fit, f"grow {current} → {fit}: {capacity} matching node(s) free, {why_goal}", True)
    return Decision(current, f"steady at {current}: {why_goal}, {capacity} matching node(s) available")


# ---- node failure ------------------------------------------------------------------------------------------------


def pods_to_force_delete(pods: Iterable[PodView], nodes: Mapping[str, NodeView], now: float,
                         grace_s: float = 120.0) -> list[tuple[str, str]]:
    """(pod, reason) for pods on a node that is gone or NotReady for longer than `grace_s`.

    The kubelet of such a node cannot confirm the pod stopped, so it stays Terminating forever and the
    job cannot restart elsewhere; a force delete (grace period 0) frees its place.
    """
    out = []
    for pod in pods:
        if pod.node is None:
            continue
        node = nodes.get(pod.node)
        if node is None:
            out.append((pod.name, f"node {pod.node} no longer exists"))
        elif not node.ready and node.not_ready_since is not None and now - node.not_ready_since >= grace_s:
            out.append((pod.name, f"node {pod.node} NotReady for {now - node.not_ready_since:.0f}s "
                                  f"(grace {grace_s:.0f}s)"))
    return out


def record_node_failures(history: Mapping[str, int], failed_nodes: Iterable[str]) -> dict[str, int]:
    """Failure counts per node (kept in status), each failure event counted once per node."""
    out = dict(history)
    for name in set(failed_nodes):
        out[name] = out.get(name, 0) + 1
    return out


def nodes_to_avoid(history: Mapping[str, int], threshold: int = 2) -> list[str]:
    return sorted(n for n, c in history.items() if c >= threshold)


def avoid_affinity(avoid: Iterable[str]) -> dict | None:
    """A pod `affinity` keeping workers off the given nodes (None when there are none)."""
    names = sorted(set(avoid))
    if not names:
        return None
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "NotIn", "values": names}]}]}}}


def with_avoided_nodes(affinity: Mapping | None, avoid: Iterable[str]) -> dict | None:
    """`affinity` (a core/v1 Affinity, as the user wrote it) that also keeps pods off `avoid`.

    Required nodeSelectorTerms are ORed, so the NotIn expression is added to every term (or forms the only
    term), which ANDs it with whatever the user required.
    """
    names = sorted(set(avoid))
    if not names:
        return dict(affinity) if affinity else None
    expr = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": names}
    out = {k: v for k, v in (affinity or {}).items()}
    node_aff = dict(out.get("nodeAffinity") or {})
    required = dict(node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or []] or [{}]
    for t in terms:
        t["matchExpressions"] = list(t.get("matchExpressions") or []) + [expr]
    required["nodeSelectorTerms"] = terms
    node_aff["requiredDuringSchedulingIgnoredDuringExecution"] = required
    out["nodeAffinity"] = node_aff
    return out


# ---- hang detection ------------------------------------------------------------------------------------------------


# ---- restart budget ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestartVerdict:
    action: str  # "restart" | "wait" | "fail"
    wait_s: float
    reason: str


def backoff_s(restarts: int, base_s: float = 10.0, cap_s: float = 600.0) -> float:
    """base x 2^restarts, capped: 10s, 20s, 40s, ... 600s."""
    return min(cap_s, base_s * 2 ** max(0, restarts))


def restart_decision(restarts: int, max_restarts: int, last_restart: float | None, now: float, why: str, *,
                     base_s: float = 10.0, cap_s: float = 600.0) -> RestartVerdict:
    """Whether to restart now, wait for the backoff, or give up (status.restarts has reached the budget)."""
    if restarts >= max_restarts:
        return RestartVerdict("fail", 0.0, f"{why}; restart budget spent ({restarts}/{max_restarts} restarts, "
                                           f"spec.elastic.maxRestarts)")
    delay = backoff_s(restarts - 1, base_s, cap_s) if restarts > 0 else 0.0
    if last_restart is not None and now - last_restart < delay:
        left = delay - (now - last_restart)
        return RestartVerdict("wait", left, f"{why}; restart {restarts + 1}/{max_restarts} in {left:.0f}s (backoff)")
    return RestartVerdict("restart", 0.0, f"{why}; restart {restarts + 1}/{max_restarts}")


# ---- suspend / resume ----------------------------------------------------------------------------------------------


def suspend_phase(suspend: bool, pods_alive: int, committed_step: int | None,
                  suspended_at_step: int | None) -> tuple[str | None, str]:
    """(phase or None to leave it to the job's state, message) during the suspend handshake.

    Suspending: the job's pods are deleted, each gets SIGTERM and the trainer commits a checkpoint within
    the termination grace period; only when no pod is left are the GPUs free. Resuming: the job comes
    back and the trainer restores the newest commit (the step recorded at suspension).
    """
    if suspend:
        if pods_alive:
            return "Suspended", f"suspending: waiting for {pods_alive} pod(s) to checkpoint and exit"
        at = f" at step {committed_step}" if committed_step is not None else ""
        return "Suspended", f"suspended{at}; every GPU released; set spec.suspend: false to resume"
    if suspended_at_step is not None:
        return None, f"resuming from the checkpoint of step {suspended_at_step}"
    return None, ""
