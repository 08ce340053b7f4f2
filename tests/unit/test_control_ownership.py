"""The operator never takes over an object its run does not own, and says why an apply failed (issue 13,
items 3 and 8): the pure decisions; tests/integration/test_operator_ownership.py runs them on the rig."""

from __future__ import annotations

import json
import threading

from kubernetes.client.exceptions import ApiException

from kiln.control.sync import apply_failure, foreign, refused

RUN_UID = "2b1c-run"


def existing(owners=None, kind="ConfigMap") -> dict:
    meta = {"name": "llama-spec", "namespace": "team-a"}
    if owners is not None:
        meta["ownerReferences"] = owners
    return {"kind": kind, "metadata": meta}


def test_absent_or_own_objects_may_be_applied():
    assert foreign(None, RUN_UID) is None
    assert foreign(existing([{"kind": "TrainingSpec", "name": "llama", "uid": RUN_UID}]), RUN_UID) is None


def test_someone_elses_object_is_named_not_adopted():
    for owners, held in [(None, "no owner"), ([], "no owner"),
                         ([{"kind": "Deployment", "name": "web", "uid": "x"}], "Deployment web"),
                         # a run of the same name deleted earlier: its objects wait for garbage collection
                         ([{"kind": "TrainingSpec", "name": "llama", "uid": "old"}], "TrainingSpec llama")]:
        problem = foreign(existing(owners), RUN_UID)
        assert problem is not None and "ConfigMap team-a/llama-spec exists and is not this run's" in problem
        assert held in problem
    assert foreign(existing([{"kind": "TrainingSpec", "uid": RUN_UID}]), None) is not None  # no uid: no proof


def test_a_refused_apply_is_reported_with_the_apiservers_message():
    err = ApiException(status=422, reason="Unprocessable Entity")
    err.body = json.dumps({"message": 'PyTorchJob.kubeflow.org "llama" is invalid: spec.x: Invalid value'})
    obj = {"kind": "PyTorchJob", "metadata": {"name": "llama", "namespace": "team-a"}}
    assert apply_failure(obj, err) == ('applying PyTorchJob team-a/llama failed (422): PyTorchJob.kubeflow.org '
                                       '"llama" is invalid: spec.x: Invalid value')
    err.body = "x" * 10_000  # not JSON, and long: the reason, in a bounded line
    assert apply_failure(obj, err) == "applying PyTorchJob team-a/llama failed (422): Unprocessable Entity"


def test_only_an_invalid_apply_counts_as_refused():
    def error(status, message):
        err = ApiException(status=status, reason="x")
        err.body = json.dumps({"message": message})
        return err

    assert refused(error(422, "is invalid")) and refused(error(400, "bad request"))
    # what the apiserver answers when a body does not fit the object's schema (seen on the rig, v1.36)
    assert refused(error(500, "failed to create typed patch object (ns/x; kubeflow.org/v1, Kind=PyTorchJob): "
                              ".spec...nodeSelectorTerms: expected list, got &{any}"))
    assert not refused(error(500, "etcdserver: request timed out")) and not refused(error(503, "unavailable"))
    assert not refused(error(409, "the object has been modified"))
    raw = error(500, "failed to create typed patch object (...)")
    raw.body = raw.body.encode()  # as Kube.apply gets it (no preloaded content)
    assert refused(raw) and "failed (500): failed to create typed patch object" in apply_failure(
        {"kind": "PyTorchJob", "metadata": {"name": "x", "namespace": "y"}}, raw)


# ---- the elastic tick applies through the reconcile's path (kiln.control.sync.apply_plan): same check ----

class TickKube:
    """The requests one elastic tick makes, in memory: the TrainingSpec, and the objects that exist."""

    def __init__(self, body: dict, existing: dict[str, dict]):
        from kiln.control.runs import Runs

        self.runs, self.body, self.existing = Runs(), body, existing  # existing: kind → the object as stored
        self.applied: list[dict] = []
        self.status: dict = {}
        self.annotations: dict = {}

    def trainingspec(self, namespace, name):
        return self.body

    def applied_spec(self, namespace, name):
        return None

    def applied_before(self, obj):
        return False  # this process never applied them (the run was forgotten when its namesake was deleted)

    def read(self, obj):
        return self.existing.get(obj["kind"])

    def apply(self, obj):
        self.applied.append(obj)
        return obj

    def patch_annotations(self, namespace, name, annotations):
        self.annotations.update(annotations)

    def patch_status(self, namespace, name, status):
        self.status.update(status)


def _tick(job_owner_uid: str, others_exist: bool, while_waiting=None, now=1000.0):
    """One tick of run team-a/llama (uid RUN_UID) at 4 nodes with capacity for 3: it shrinks, so it applies.
    while_waiting(job): the watch's change while the tick waits for the run's lock, which another handler holds."""
    from kiln.control import elastic_sync
    from kiln.control.config import OperatorConfig
    from kiln.control.elastic import GPU_PRODUCT_LABEL, NodeView

    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
            "metadata": {"name": "llama", "namespace": "team-a", "uid": RUN_UID,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"preset": "tiny"}, "data": {"uri": "s3://data/tokens/"},
                     "training": {"globalBatchSize": 3360, "microBatchSize": 1},
                     "parallelism": {"tensor": 2, "pipeline": 1},
                     "resources": {"nodes": 4, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"},
                     "elastic": {"minNodes": 2, "maxNodes": 8}}}
    namesake = [{"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "name": "llama", "uid": job_owner_uid}]
    job = {"kind": "PyTorchJob", "metadata": {"name": "llama", "namespace": "team-a", "ownerReferences": namesake},
           "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 4}}},
           "status": {"conditions": [{"type": "Running", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    existing = {kind: {"kind": kind, "metadata": {"name": "x", "namespace": "team-a", "ownerReferences": namesake}}
                for kind in ("ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "ConfigMap")} if others_exist else {}
    kube, events = TickKube(body, existing), []
    nodes = [NodeView(f"n{i}", labels={GPU_PRODUCT_LABEL: "NVIDIA-H200"}, gpus_free=8) for i in range(3)]
    view = {"job": job}
    seen = lambda: elastic_sync.Seen(nodes, [], view["job"], [])  # noqa: E731 - the watch's view, read when called
    tick = lambda: elastic_sync.tick(kube, "team-a", "llama", OperatorConfig(),  # noqa: E731
                                     lambda _, e: events.append(e), now, seen)
    if while_waiting is None:
        summary = tick()
    else:
        result = []
        with kube.runs[("team-a", "llama")].lock:  # another handler holds the run's lock
            waiting = threading.Thread(target=lambda: result.append(tick()))
            waiting.start()
            view["job"] = while_waiting(job)
        waiting.join()
        summary = result[0]
    elastic = next((c for c in kube.status.get("conditions") or [] if c["type"] == "Elastic"), None)
    return kube, elastic, events, summary


def test_the_elastic_tick_applies_over_its_own_job():
    kube, elastic, events, _ = _tick(RUN_UID, others_exist=False)
    jobs = [o for o in kube.applied if o["kind"] == "PyTorchJob"]
    assert [j["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] for j in jobs] == [3]  # shrunk: 3 nodes fit
    assert (elastic["status"], elastic["reason"]) == ("True", "Shrink")
    assert [e.reason for e in events] == ["Scaling"]


def test_a_tick_that_waited_for_the_runs_lock_decides_from_the_watch_as_it_is_then():
    # the job finished while the tick waited for the lock: rescaling from the view read before would patch a
    # finished job (the view is read again under the lock: sync.observed_now)
    finished = {"type": "Succeeded", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"}
    kube, elastic, events, summary = _tick(RUN_UID, others_exist=False,
                                           while_waiting=lambda job: {**job, "status": {"conditions": [finished]}})
    assert summary == "team-a/llama: not running"
    assert kube.applied == [] and events == [] and elastic is None


def test_a_tick_that_waited_for_the_runs_lock_stamps_its_decision_with_the_time_it_got_it():
    # stamped with the time it began waiting, its decision (and its status write's goodput ledger) would be older
    # than what another handler wrote meanwhile: the ledger then prices nothing up to this write
    from kiln.control.elastic_state import ANNOTATION

    clock = {"t": 1000.0}

    def time_passes(job):
        clock["t"] = 1010.0
        return job

    kube, elastic, _, _ = _tick(RUN_UID, others_exist=False, while_waiting=time_passes, now=lambda: clock["t"])
    assert (elastic["status"], elastic["reason"]) == ("True", "Shrink")
    assert json.loads(kube.annotations[ANNOTATION])["lastChange"] == 1010.0


def test_the_elastic_tick_refuses_to_patch_a_job_owned_by_another_trainingspec():
    # a TrainingSpec deleted and made again under the same name: the old run's job still runs, waiting for the
    # garbage collector; the new run's tick would have taken it over (server-side apply with force)
    for others_exist in (True, False):
        kube, elastic, events, _ = _tick("old-uid", others_exist)
        assert not [o for o in kube.applied if o["kind"] == "PyTorchJob"]
        if others_exist:  # every object of the old run's: none is applied
            assert kube.applied == []
        assert (elastic["status"], elastic["reason"]) == ("False", "NotOwner")
        first = "ServiceAccount team-a/x" if others_exist else "PyTorchJob team-a/llama"  # the first one refused
        assert f"shrink 4 → 3: only 3 matching node(s) available; not applied: {first} exists and is not this " \
               "run's (TrainingSpec llama)" in elastic["message"]
        assert "Scaling" not in [e.reason for e in events]
        # not recorded as done: the next tick decides again (the node count stays the spec's)
        from kiln.control.elastic_state import ANNOTATION

        assert '"nodes": 3' not in kube.annotations.get(ANNOTATION, "")
