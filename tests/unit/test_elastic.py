"""Elastic decisions of the operator: bounds, whole data-parallel groups, capacity, plan, failures, hangs, budget."""

import pytest
from hypothesis import given, settings, strategies as st

from kiln.api.spec import TrainingSpecSpec
from kiln.api import hang as hang_rule
from kiln.control import elastic as el
from kiln.control.elastic import NodeView, PodView


def spec(**over) -> TrainingSpecSpec:
    doc = {"model": {"preset": "tiny"},
           "training": {"globalBatchSize": 3360, "microBatchSize": 1},  # whole for dp = 4 x (2..8)
           "parallelism": {"tensor": 2, "pipeline": 1},
           "resources": {"nodes": 4, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"},
           "elastic": {"minNodes": 2, "maxNodes": 8}}
    for path, value in over.items():
        d = doc
        *head, last = path.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = value
    return TrainingSpecSpec.model_validate(doc)


def gpu_nodes(n, free=8, gpu="NVIDIA-H200", **kw):
    return [NodeView(f"n{i}", labels={el.GPU_PRODUCT_LABEL: gpu}, gpus_free=free, **kw) for i in range(n)]


def test_grows_to_free_capacity_up_to_max():
    d = el.desired_nodes(spec(), gpu_nodes(6), current=4)
    assert (d.nodes, d.changed) == (6, True) and "grow 4 → 6" in d.reason
    assert el.desired_nodes(spec(), gpu_nodes(20), current=4).nodes == 8


def test_shrinks_when_nodes_vanish_and_waits_at_min():
    nodes = gpu_nodes(4)
    nodes[3] = NodeView("n3", ready=False, labels=nodes[3].labels, gpus_free=8)
    d = el.desired_nodes(spec(), nodes, current=4)
    assert (d.nodes, d.changed) == (3, True) and "only 3 matching" in d.reason
    d = el.desired_nodes(spec(), gpu_nodes(1), current=3)
    assert d.nodes == 2 and "waiting for capacity" in d.reason and "minNodes 2" in d.reason


def test_only_matching_nodes_with_enough_gpus_count():
    nodes = gpu_nodes(2) + gpu_nodes(3, gpu="nvidia-a100") + gpu_nodes(3, free=4)
    nodes = [NodeView(f"x{i}", labels=n.labels, gpus_free=n.gpus_free) for i, n in enumerate(nodes)]
    assert el.placeable_nodes(spec(), nodes) == ["x0", "x1"]
    cordoned = [NodeView("c", labels={el.GPU_PRODUCT_LABEL: "NVIDIA-H200"}, gpus_free=8, unschedulable=True)]
    assert el.placeable_nodes(spec(), cordoned) == []
    sel = spec(**{"resources.nodeSelector": {"pool": "a"}})
    assert el.placeable_nodes(sel, [NodeView("p", labels={el.GPU_PRODUCT_LABEL: "NVIDIA-H200", "pool": "a"},
                                              gpus_free=8)] + gpu_nodes(2)) == ["p"]


def test_whole_groups_and_constant_global_batch():
    # 2 GPUs per node, tensor 2 x pipeline 2: a model replica spans 2 nodes, so only even counts work;
    # global batch 64 over dp = nodes / 2 replicas must stay whole: dp 3 (6 nodes) would change it.
    s = spec(**{"training.globalBatchSize": 64, "resources.gpusPerNode": 2, "parallelism.pipeline": 2})
    assert el.valid_node_counts(s) == [2, 4, 8]
    d = el.desired_nodes(s, gpu_nodes(7), current=4)
    assert d.nodes == 4 and not d.changed and "steady" in d.reason
    assert el.desired_nodes(s, gpu_nodes(3), current=4).nodes == 2


def test_growth_waits_for_cooldown_but_shrink_does_not():
    d = el.desired_nodes(spec(), gpu_nodes(8), current=4, now=100, last_change=50, grow_cooldown_s=300)
    assert d.nodes == 4 and "cooldown" in d.reason
    d = el.desired_nodes(spec(), gpu_nodes(8), current=4, now=400, last_change=50, grow_cooldown_s=300)
    assert d.nodes == 8
    d = el.desired_nodes(spec(), gpu_nodes(3), current=4, now=100, last_change=50)
    assert d.nodes == 3


def test_phase_plan_switches_by_committed_step():
    s = spec(**{"elastic.plan": [{"untilStep": 1000, "nodes": 2}, {"nodes": 8}]})
    assert el.plan_boundaries(s) == [1000]
    assert el.desired_nodes(s, gpu_nodes(8), current=4, committed_step=500).nodes == 2
    assert el.desired_nodes(s, gpu_nodes(8), current=2, committed_step=999).nodes == 2
    d = el.desired_nodes(s, gpu_nodes(8), current=2, committed_step=1000)
    assert d.nodes == 8 and "phase plan asks for 8" in d.reason
    assert el.desired_nodes(s, gpu_nodes(5), current=2, committed_step=1000).nodes == 5


def test_avoided_nodes_are_not_capacity():
    hist = el.record_node_failures({}, ["n1"])
    hist = el.record_node_failures(hist, ["n1", "n1", "n2"])  # one event counts once per node
    assert hist == {"n1": 2, "n2": 1}
    avoid = el.nodes_to_avoid(hist)
    assert avoid == ["n1"]
    assert "n1" not in el.placeable_nodes(spec(), gpu_nodes(4), avoid)
    aff = el.avoid_affinity(avoid)
    expr = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert expr["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]
    assert el.avoid_affinity([]) is None


def test_force_delete_only_after_grace_on_notready_or_missing_nodes():
    nodes = {"ok": NodeView("ok"), "bad": NodeView("bad", ready=False, not_ready_since=1000.0)}
    pods = [PodView("w0", "ok"), PodView("w1", "bad"), PodView("w2", "gone"), PodView("w3", None)]
    assert [p for p, _ in el.pods_to_force_delete(pods, nodes, now=1060, grace_s=120)] == ["w2"]
    out = dict(el.pods_to_force_delete(pods, nodes, now=1130, grace_s=120))
    assert set(out) == {"w1", "w2"} and "NotReady for 130s" in out["w1"] and "no longer exists" in out["w2"]


def test_hang_uses_p99_times_factor_with_floor():
    times = [1.0] * 98 + [2.0, 3.0]
    assert hang_rule.p99(times) == 2.0
    assert hang_rule.hang(times, last_progress=0, now=59, factor=10, floor_s=60) is None
    assert hang_rule.hang(times, last_progress=0, now=61, factor=10, floor_s=10) is not None
    slow = [30.0] * 10
    assert hang_rule.hang(slow, last_progress=0, now=200, factor=10) is None
    reason = hang_rule.hang(slow, last_progress=0, now=301, factor=10)
    assert "no training step completed for 301s" in reason and "limit 300s" in reason
    assert hang_rule.hang([1.0] * 3, last_progress=0, now=10_000) is None  # no baseline yet


def test_restart_budget_with_backoff():
    v = el.restart_decision(0, 3, None, now=0, why="hang")
    assert v.action == "restart" and "1/3" in v.reason
    assert el.restart_decision(1, 3, last_restart=100, now=105, why="x").action == "wait"
    assert el.restart_decision(1, 3, last_restart=100, now=111, why="x").action == "restart"
    assert el.restart_decision(2, 3, last_restart=100, now=115, why="x").action == "wait"  # 20 s now
    v = el.restart_decision(3, 3, last_restart=0, now=1e9, why="node lost")
    assert v.action == "fail" and "maxRestarts" in v.reason
    assert [el.backoff_s(r) for r in range(8)] == [10, 20, 40, 80, 160, 320, 600, 600]


def test_suspend_handshake_phases():
    assert el.suspend_phase(True, 2, 100, None) == ("Suspended", "suspending: waiting for 2 pod(s) to checkpoint and exit")
    phase, msg = el.suspend_phase(True, 0, 120, None)
    assert phase == "Suspended" and "step 120" in msg and "released" in msg
    assert el.suspend_phase(False, 0, 120, 120) == (None, "resuming from the checkpoint of step 120")


@settings(max_examples=300, deadline=None)
@given(ppn=st.sampled_from([1, 2, 4, 8]), tp_i=st.integers(0, 3), pp=st.sampled_from([1, 2, 4]),
       lo=st.integers(1, 6), span=st.integers(0, 10), free=st.integers(0, 20), current=st.integers(1, 20),
       step=st.integers(0, 3000), plan_i=st.integers(0, 20), gbs=st.sampled_from([64, 96, 3360, 720720]))
def test_decision_is_always_within_bounds_and_whole_groups(ppn, tp_i, pp, lo, span, free, current, step, plan_i,
                                                           gbs):
    from hypothesis import assume
    from pydantic import ValidationError

    tp = [d for d in (1, 2, 4, 8) if ppn % d == 0][tp_i % len([d for d in (1, 2, 4, 8) if ppn % d == 0])]
    hi = lo + span
    start = next((n for n in range(lo, hi + 1) if (n * ppn) % (tp * pp) == 0
                  and gbs % (n * ppn // (tp * pp)) == 0), None)
    assume(start is not None)
    try:
        s = TrainingSpecSpec.model_validate({
            "model": {"preset": "tiny", "layers": 8, "heads": 8, "kvHeads": 8},
            "training": {"globalBatchSize": gbs, "microBatchSize": 1},
            "parallelism": {"tensor": tp, "pipeline": pp, "fsdp": False},
            "resources": {"nodes": start, "gpusPerNode": ppn},
            "elastic": {"minNodes": lo, "maxNodes": hi,
                        "plan": [{"untilStep": 1000, "nodes": lo + plan_i % (span + 1)}, {"nodes": hi}]}},
            context={"rules": "all"})  # as kiln validate and the apiserver: the layout at every planned count
    except ValidationError:
        assume(False)
    nodes = [NodeView(f"n{i}", gpus_free=ppn) for i in range(free)]
    d = el.desired_nodes(s, nodes, current, committed_step=step)
    assert lo <= d.nodes <= hi
    assert el.valid_node_count(s, d.nodes)  # whole tensor x pipeline groups, global batch unchanged
    assert (d.nodes * ppn) % (tp * pp) == 0
    assert d.nodes <= max(free, min(el.valid_node_counts(s)))  # never more than fits, except waiting at min
    assert d.changed == (d.nodes != current)


def test_node_views_count_gpus_left_by_other_pods_and_readiness():
    from kiln.control.elastic_state import carried_nodes
    from kiln.control.elastic_sync import node_views
    from kiln.api.spec import TrainingSpec

    node = lambda name, ready, since=None: {  # noqa: E731
        "metadata": {"name": name, "labels": {el.GPU_PRODUCT_LABEL: "NVIDIA-H200"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                   "lastTransitionTime": since or "2026-01-01T00:00:00Z"}]}}
    pod = lambda ns, run, node, gpus, phase="Running": {  # noqa: E731
        "metadata": {"namespace": ns, "labels": {"kiln.dev/trainingspec": run} if run else {}},
        "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": phase}}
    views = node_views([node("a", True), node("b", False, "2026-01-01T00:01:40Z")],
                       [pod("ml", "run", "a", 8), pod("other", None, "a", 2), pod("ml", "x", "b", 8, "Succeeded")],
                       ("ml", "run"))
    a, b = views
    assert (a.gpus_free, a.ready) == (6, True)  # our own 8 count as free, the other team's 2 do not
    assert (b.gpus_free, b.ready, b.not_ready_since) == (8, False, 1767225700.0)

    doc = TrainingSpec.model_validate({"metadata": {"name": "r"}, "spec": spec().model_dump(by_alias=True)})
    ann = lambda n: {"metadata": {"annotations": {"kiln.dev/elastic-state": f'{{"nodes": {n}}}'}}}  # noqa: E731
    assert carried_nodes(ann(6), doc) == 6
    assert carried_nodes(ann(9), doc) is None  # outside [minNodes, maxNodes] after a spec edit
    assert carried_nodes({}, doc) is None


def test_the_ticks_view_follows_node_and_pod_events_without_listing():
    # The operator's tick reads nodes and GPU-holding pods from kopf indexes (kiln.control.handlers); here kopf's
    # own index store is fed what kiln's index functions return, event by event, as kopf's watch would.
    from kopf._core.engines.indexing import OperatorIndexer

    from kiln.control import handlers, indexes
    from kiln.control.elastic_sync import free_gpus

    nodes, gpus = OperatorIndexer(), OperatorIndexer()
    node = lambda ready: {  # noqa: E731
        "metadata": {"name": "a", "uid": "na", "labels": {el.GPU_PRODUCT_LABEL: "NVIDIA-H200"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"},
                   "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    pod = lambda name, ns, run, gpus, phase="Running", node="a": {  # noqa: E731
        "metadata": {"name": name, "uid": name, "namespace": ns,
                     "labels": {"kiln.dev/trainingspec": run} if run else {}},
        "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": phase}}

    def event(indexer, body, deleted=False):
        key = (body["metadata"].get("namespace"), body["metadata"]["name"], body["metadata"]["uid"])
        if deleted:
            indexer.discard(key)
        else:
            indexer.replace(key, (handlers.cluster_nodes if indexer is nodes else handlers.gpu_pods)(body=body))

    def view():
        (a,) = free_gpus(indexes.values(nodes.index), indexes.values(gpus.index), ("ml", "run"))
        return a.gpus_free, a.ready

    event(nodes, node(True))
    for p in (pod("ours", "ml", "run", 8), pod("other", "team", None, 2), pod("cpu", "team", None, 0),
              pod("pending", "team", None, 4, "Pending", node=None)):
        event(gpus, p)
    assert view() == (6, True)  # our own 8 count as free; the unplaced and the GPU-less pods hold none
    assert len(gpus.index) == 1 and len(list(gpus.index["a"])) == 2  # only GPU-holding pods are kept
    event(gpus, pod("other", "team", None, 2, "Succeeded"))
    assert view() == (8, True)  # a finished pod gives its GPUs back (indexed to {}: its entry is dropped)
    event(gpus, pod("late", "team", None, 3))
    event(gpus, pod("late", "team", None, 3), deleted=True)
    event(nodes, node(False))
    assert view() == (8, False)
    event(nodes, node(False), deleted=True)
    assert free_gpus(indexes.values(nodes.index), indexes.values(gpus.index), ("ml", "run")) == []


def test_avoided_nodes_are_anded_into_the_users_affinity_and_rendered_by_plan():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}},
        "podAntiAffinity": {"x": 1}}
    out = el.with_avoided_nodes(user, ["n2", "n1"])
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    notin = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]}
    assert [t["matchExpressions"][-1] for t in terms] == [notin, notin]  # ANDed into every ORed term
    assert out["podAntiAffinity"] == {"x": 1}
    assert len(user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
               ["matchExpressions"]) == 1  # the spec's own value is not mutated
    assert el.with_avoided_nodes(None, []) is None and el.with_avoided_nodes(user, []) == user

    from kiln.api.spec import TrainingSpec
    from kiln.control.plan import Observed, plan

    doc = TrainingSpec.model_validate({"metadata": {"name": "r", "namespace": "ml", "uid": "u"},
                                       "spec": spec().model_dump(by_alias=True, exclude_none=True)})
    job = next(o for o in plan(doc, Observed(nodes=6, avoid_nodes=("n1",))).objects if o["kind"] == "PyTorchJob")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 6
    aff = worker["template"]["spec"]["affinity"]["nodeAffinity"]
    assert aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]}]


def test_a_queued_run_starts_at_min_nodes_and_keeps_the_count_kueue_admitted():
    queued = spec(**{"scheduling.queue": "team-a"})
    assert (el.start_nodes(queued), el.start_nodes(spec())) == (2, 4)  # minNodes 2; resources.nodes 4
    # a global batch of 64 splits over 2, 4 or 8 nodes (dp 8, 16, 32), not 3: the smallest runnable from minNodes up
    odd = spec(**{"scheduling.queue": "team-a", "elastic.minNodes": 3, "training.globalBatchSize": 64})
    assert el.start_nodes(odd) == 4
    for free in (0, 2, 20):  # neither growth into free nodes nor a shrink: Kueue sized the Workload
        d = el.desired_nodes(queued, gpu_nodes(free), current=2)
        assert (d.nodes, d.changed) == (2, False) and d.reason.startswith("queued:"), d


def test_a_tick_asks_nothing_of_a_job_suspended_by_its_spec_before_the_training_operator_marks_it():
    # a run created suspended (or held by Kueue): in a burst the training-operator marks its job only later, and
    # the run's first ticks read the TrainingSpec for nothing
    from kiln.control import elastic_sync

    created = {"metadata": {"name": "run"}, "spec": {"runPolicy": {"suspend": True}}}
    seen = elastic_sync.Seen([], [], created, [])
    # no Kube, no config: any request (or the run's lock) would fail
    assert elastic_sync.tick(None, "ml", "run", None, None, 0.0, seen) == "ml/run: not running"
    running = {"spec": {"runPolicy": {"suspend": False}},
               "status": {"conditions": [{"type": "Running", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    assert elastic_sync.runs(running) and not elastic_sync.runs(None)
    assert not elastic_sync.runs({**running, "status": {"conditions": [
        {"type": "Succeeded", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
