"""Failover from GPU health: move a run off a node whose GPUs NVML reports Degrading (often before they fail it)
or Failing (often when the process on them is failing already). Pure.

Trainer rank 0 reports each node's GPU health in status.gpuHealth (kiln.trainer.observe.gpu_health). The operator's tick
(kiln.control.elastic_sync, through `step`) calls `decide` with that report, the nodes the run's live pods are on, the nodes
it already avoids and how many nodes would still host a worker without the bad ones; on a move it keeps new
pods off the node (the hostname NotIn affinity of kiln.control.elastic), deletes the run's pods gracefully
so the trainers commit on SIGTERM (the suspend handshake: every rank agrees on a step and saves it), and the
training-operator recreates them elsewhere; they resume from that commit. `moved_off` says when the trainer
reports from the new nodes; until then the GPUHealthy condition's reason is MOVING, which the goodput ledger
prices as `gpuFailover` (kiln.control.goodput).

The pre-flight check before step 1 (kiln.trainer.observe.preflight) takes the same path: a node with a rank
below resources.preflight.minRelativeSpeed in status.preflight.slow is read as a Degrading node
(`preflight_entries`), so the run leaves it when it can start elsewhere (elastic bounds and free capacity) and
otherwise stays there with a GPUDegraded Event saying why (a pre-flight node that the elastic bounds cannot do
without fails the run in the trainer first, on GPUs: kiln.trainer.observe.preflight.cannot_leave). A straggler
(status.stragglers: a rank slower than the others for resources.stragglers.window reports in a row) is read the
same way (`straggler_entries`): its node is left at a commit when the run can start without it, and otherwise
the run trains on and the GPUHealthy condition says why it stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kiln.api.contract import GPU_DEGRADING, GPU_FAILING, GPU_HEALTHY, GPU_MOVE_STATES, GPU_NOT_APPLICABLE, GPU_UNKNOWN
from kiln.api.spec import TrainingSpecSpec
from kiln.control import elastic
from kiln.control.elastic_state import avoided

MOVING = "MovingOffNode"  # GPUHealthy reason while the run moves; goodput's `gpuFailover` follows it


@dataclass(frozen=True)
class Verdict:
    move: dict[str, str]  # node → why it is left (empty: stay where the run is)
    reason: str  # one line: what was decided and why (the Event's message on a move)
    staying: str = ""  # on a stay: why the run trains on where it is (the GPUHealthy condition says it)


def bad_nodes(reported: Iterable[dict], running_on: Iterable[str], avoided: Iterable[str]) -> dict[str, str]:
    """node → why, for each node the run has a live pod on whose GPUs report Degrading or Failing and that
    is not avoided yet (a node being left already is not decided about again)."""
    running, avoid = set(running_on), set(avoided)
    return {e["node"]: _why(e) for e in reported
            if e.get("state") in GPU_MOVE_STATES and e["node"] in running and e["node"] not in avoid}


def decide(reported: Iterable[dict], running_on: Iterable[str], avoided: Iterable[str], capacity_without: int,
           needed: int) -> Verdict:
    """Whether to move the run off its Degrading or Failing nodes now.

    capacity_without: how many nodes could host a worker if the bad ones (and those already avoided) were
    left; needed: the fewest nodes the run starts at (minNodes, in whole data-parallel groups). A Failing GPU
    is left even when nothing else has room (it would fail the run anyway; the pods then wait for capacity);
    a Degrading one only when the run can start elsewhere.
    """
    reported = list(reported)
    bad = bad_nodes(reported, running_on, avoided)
    if not bad:
        return Verdict({}, "")
    failing = any(e.get("state") == GPU_FAILING and e["node"] in bad for e in reported)
    where = "; ".join(f"node {n}: {why}" for n, why in sorted(bad.items()))
    if capacity_without < needed and not failing:
        why = f"only {capacity_without} other node(s) could host a worker, the run needs {needed}"
        return Verdict({}, f"staying on {', '.join(sorted(bad))} ({where}): {why}", f"the run trains on there: {why}")
    room = "" if capacity_without >= needed else \
        f"; only {capacity_without} other node(s) have room for the {needed} needed: the pods wait for capacity"
    return Verdict(bad, f"moving off {', '.join(sorted(bad))} ({where}): a commit is requested (the pods get "
                        f"SIGTERM and the trainers save), then the run restarts without the node(s){room}")


def moved_off(reported: Iterable[dict], leaving: Iterable[str]) -> bool:
    """Whether the trainer reports from elsewhere: a report that names none of the nodes being left."""
    reported, leaving = list(reported), set(leaving)
    return bool(reported) and not any(e["node"] in leaving for e in reported)


def condition(reported: Iterable[dict], moving: dict | None = None, moved: dict | None = None,
              staying: str | None = None) -> tuple[str, str, str] | None:
    """The GPUHealthy condition (status, reason, message), or None before any report.

    moving: {"nodes": {node: why}, "step": …} while a move is under way; moved: the last finished one, named
    in the message so the condition keeps saying why the run left a node; staying: why the run stays on a bad
    node (decide's reason), said while the node is still reported bad.
    """
    reported = list(reported)
    if moving:
        where = "; ".join(f"node {n}: {why}" for n, why in sorted(moving["nodes"].items()))
        return "False", MOVING, f"moving the run off {where}; commit requested at step {moving.get('step')}"
    if not reported:
        return None
    after = ""
    if moved:
        after = f"; moved off {', '.join(sorted(moved['nodes']))} at step {moved.get('step')} " \
                f"({'; '.join(f'{n}: {w}' for n, w in sorted(moved['nodes'].items()))})"
    bad = [e for e in reported if e.get("state") in GPU_MOVE_STATES]
    if bad:
        reason = "GPUFailing" if any(e["state"] == GPU_FAILING for e in bad) else "GPUDegrading"
        stays = f"; {staying}" if staying else ""
        return "False", reason, "; ".join(f"node {e['node']}: {_why(e)}" for e in bad) + stays + after
    unknown = [e for e in reported if e.get("state") == GPU_UNKNOWN]
    if unknown:
        return "Unknown", "GPUHealthUnknown", "; ".join(f"node {e['node']}: {_why(e)}" for e in unknown) + after
    if all(e.get("state") == GPU_NOT_APPLICABLE for e in reported):
        return "Unknown", "NotApplicable", "the run uses no GPU (" + "; ".join(
            f"node {e['node']}: {e.get('message') or 'no GPU'}" for e in reported) + ")" + after
    gpus = sum(len(e.get("gpus") or []) for e in reported if e.get("state") == GPU_HEALTHY)
    return "True", "GPUsHealthy", f"{gpus} GPU(s) on {len(reported)} node(s) healthy" + after


@dataclass(frozen=True)
class Step:
    """What one tick does about GPU health (kiln.control.elastic_sync applies it)."""

    state: dict = field(default_factory=dict)  # updates of the elastic state annotation
    move: dict[str, str] = field(default_factory=dict)  # nodes to leave now: re-plan without them, delete pods
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    condition: tuple[str, str, str] | None = None  # GPUHealthy
    strays: list[str] = field(default_factory=list)  # pods to delete again: live on a node being left


def step(spec: TrainingSpecSpec, status: dict, state: dict, pods: Iterable[dict],
         nodes: Iterable[elastic.NodeView]) -> Step:
    """One tick's GPU-health decision for a running run, from its status (gpuHealth, step), the elastic state
    (gpuAvoid: nodes left for their GPUs; gpuFailover: a move under way; gpuMoved: the last one finished),
    its pods and the nodes (free GPUs as the elastic loop counts them)."""
    reported = list(status.get("gpuHealth") or []) + preflight_entries(status) + straggler_entries(status)
    moving = state.get("gpuFailover")
    pods = list(pods)
    live = {(p.get("metadata") or {}).get("name"): (p.get("spec") or {}).get("nodeName") for p in pods
            if not (p.get("metadata") or {}).get("deletionTimestamp")}
    if moving:
        if not moved_off(reported, moving["nodes"]):
            # a pod the training-operator recreated from the template as it was before the new affinity
            strays = sorted(name for name, node in live.items() if node in moving["nodes"])
            return Step(condition=condition(reported, moving), strays=strays)
        where = ", ".join(sorted(e["node"] for e in reported))
        return Step(state={"gpuFailover": None, "gpuMoved": moving},
                    events=[("Normal", "GPUFailoverDone", f"the run reports from {where}, off "
                             f"{', '.join(sorted(moving['nodes']))} (left at step {moving.get('step')})")],
                    condition=condition(reported, moved=moving))
    running_on = set(live.values()) - {None}
    avoid = avoided(state)
    bad = bad_nodes(reported, running_on, avoid)
    nodes = list(nodes)
    capacity = len(elastic.placeable_nodes(spec, nodes, set(avoid) | set(bad)))
    needed = min(elastic.valid_node_counts(spec) or [elastic.bounds(spec)[0]])
    verdict = decide(reported, running_on, avoid, capacity, needed)
    moved = state.get("gpuMoved")
    if verdict.move:
        started = {"nodes": verdict.move, "step": status.get("step")}
        return Step(state={"gpuAvoid": {**(state.get("gpuAvoid") or {}), **verdict.move}, "gpuFailover": started,
                           "gpuStaying": None},
                    move=verdict.move, events=[("Warning", "GPUFailover", verdict.reason)],
                    condition=condition(reported, started))
    if verdict.reason and verdict.reason != state.get("gpuStaying"):  # said once, not every tick
        return Step(state={"gpuStaying": verdict.reason}, events=[("Warning", "GPUDegraded", verdict.reason)],
                    condition=condition(reported, moved=moved, staying=verdict.staying))
    return Step(condition=condition(reported, moved=moved, staying=verdict.staying))


def preflight_entries(status: dict) -> list[dict]:
    """status.preflight's slow ranks as Degrading gpuHealth-like entries, one per node (its slowest rank)."""
    slow: dict[str, dict] = {}
    for s in (status.get("preflight") or {}).get("slow") or []:
        if s.get("node") and (s["node"] not in slow or s["relative"] < slow[s["node"]]["relative"]):
            slow[s["node"]] = s
    return [{"node": node, "state": GPU_DEGRADING,
             "message": f"pre-flight: rank {s['rank']}'s matmul at {s['relative']} of the other ranks' median"}
            for node, s in sorted(slow.items())]


def straggler_entries(status: dict) -> list[dict]:
    """status.stragglers (ranks the trainer named: slow for resources.stragglers.window reports in a row) as
    Degrading gpuHealth-like entries, one per node (its slowest rank)."""
    slow: dict[str, dict] = {}
    for s in status.get("stragglers") or []:
        if s.get("node") and (s["node"] not in slow or s["relative"] > slow[s["node"]]["relative"]):
            slow[s["node"]] = s
    return [{"node": node, "state": GPU_DEGRADING,
             "message": f"straggler: rank {s['rank']}'s own step time at {s['relative']}x the other ranks' median"
                        + (f" (named at step {s['step']})" if s.get("step") is not None else "")}
            for node, s in sorted(slow.items())]


def _why(entry: dict) -> str:
    return f"{entry.get('state')}: {entry.get('message') or 'no detail'}"
