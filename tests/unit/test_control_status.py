"""derive(): PyTorchJob conditions + pods → TrainingSpec phase, conditions, Events (pure)."""

from __future__ import annotations

import pytest

from kiln.control.job_state import job_condition
from kiln.control.status import changed, derive, pods_to_stop

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"
APPLIED = ("True", "Applied", "ok")


def ts(status: dict | None = None, suspend: bool = False, generation: int = 3) -> dict:
    return {"metadata": {"name": "run", "namespace": "ml", "generation": generation},
            "spec": {"suspend": suspend, "training": {"steps": 200}}, "status": status or {}}


def job(*conditions: tuple[str, str], replicas: int = 2) -> dict:
    return {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": replicas}}},
            "status": {"conditions": [{"type": t, "status": "True", "lastTransitionTime": when,
                                       "message": f"job {t.lower()}"} for t, when in conditions]}}


def pod(name: str, phase: str = "Running", **status) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase, **status}}


RUNNING_PODS = [pod("run-worker-0"), pod("run-worker-1")]


@pytest.mark.parametrize("conditions,pods,suspend,phase", [
    ((), [], False, "Pending"),
    ((("Created", T0),), [pod("run-worker-0", "Pending")], False, "Pending"),
    ((("Created", T0), ("Running", T1)), RUNNING_PODS, False, "Running"),
    ((("Created", T0), ("Running", T1)), RUNNING_PODS[:1] + [pod("run-worker-1", "Pending")], False, "Scaling"),
    ((("Running", T0), ("Restarting", T1)), RUNNING_PODS[:1], False, "Restarting"),
    ((("Running", T0), ("Succeeded", T1)), [], False, "Succeeded"),
    ((("Running", T0), ("Failed", T1)), [], False, "Failed"),
    ((("Running", T0), ("Suspended", T1)), [], True, "Suspended"),
    ((("Running", T0),), RUNNING_PODS, True, "Suspended"),  # suspend requested: pods are going away
    ((("Created", T0), ("Suspended", T1)), [], False, "Pending"),  # held by a queue (Kueue), not by the user
    ((("Running", T1), ("Succeeded", T1)), [], False, "Succeeded"),  # same second: the final state wins
])
def test_phase(conditions, pods, suspend, phase):
    j = job(*conditions) if conditions else None
    assert derive(ts(suspend=suspend), j, pods, T2, APPLIED).status["phase"] == phase


def test_conditions_follow_metav1_semantics():
    first = derive(ts(), job(("Running", T0)), RUNNING_PODS, T1, APPLIED).status
    conds = {c["type"]: c for c in first["conditions"]}
    assert conds["Running"]["status"] == "True" and conds["Running"]["lastTransitionTime"] == T1
    assert conds["SpecAccepted"] == {"type": "SpecAccepted", "status": "True", "reason": "Applied", "message": "ok",
                                     "lastTransitionTime": T1, "observedGeneration": 3}
    assert conds["Failed"]["status"] == "False"
    assert first["observedGeneration"] == 3 and first["nodes"] == 2
    # unchanged status keeps its transition time; a flip gets the new time
    second = derive(ts(first), job(("Running", T0), ("Succeeded", T2)), [], T2, APPLIED).status
    conds2 = {c["type"]: c for c in second["conditions"]}
    assert conds2["SpecAccepted"]["lastTransitionTime"] == T1
    assert conds2["Succeeded"] == {**conds2["Succeeded"], "status": "True", "lastTransitionTime": T2}
    assert conds2["Running"]["status"] == "False"


def test_events_only_on_transitions():
    d1 = derive(ts(), job(("Running", T0)), RUNNING_PODS, T1, APPLIED)
    assert [(e.type, e.reason) for e in d1.events] == [("Normal", "Running")]
    d2 = derive(ts(d1.status), job(("Running", T0)), RUNNING_PODS, T2, APPLIED)
    assert d2.events == [] and d2.status == {**d1.status, **{k: d2.status[k] for k in ("goodput", "goodputDetail")}}
    d3 = derive(ts(d2.status), job(("Running", T0), ("Restarting", T2)), RUNNING_PODS[:1], T2, None)
    assert [(e.type, e.reason) for e in d3.events] == [("Warning", "Restarting")]
    assert d3.status["restarts"] == 1
    d4 = derive(ts(d3.status), job(("Running", T0), ("Restarting", T2)), RUNNING_PODS[:1], T2, None)
    assert d4.status["restarts"] == 1  # still the same restart


def test_unschedulable_pods_are_reported():
    pending = pod("run-worker-1", "Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}])
    d = derive(ts(), job(("Created", T0)), [pending], T1, APPLIED)
    cond = next(c for c in d.status["conditions"] if c["type"] == "PodsScheduled")
    assert cond["status"] == "False" and "Insufficient nvidia.com/gpu" in cond["message"]
    assert any(e.reason == "Unschedulable" and e.type == "Warning" for e in d.events)
    again = derive(ts(d.status), job(("Created", T0)), [pending], T2, APPLIED)
    assert not any(e.reason == "Unschedulable" for e in again.events)


def test_missing_secret_and_bad_image_reach_the_user():
    waiting = pod("run-worker-0", "Pending", containerStatuses=[{"name": "pytorch", "state": {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "s3" not found'}}}])
    d = derive(ts(), job(("Created", T0)), [waiting], T1, APPLIED)
    assert any(e.reason == "ContainerConfigError" and 'secret "s3" not found' in e.message for e in d.events)
    pull = pod("run-worker-0", "Pending", containerStatuses=[{"name": "pytorch", "state": {"waiting": {
        "reason": "InvalidImageName", "message": "couldn't parse image"}}}])
    assert any(e.reason == "InvalidImage" for e in derive(ts(), job(), [pull], T1, APPLIED).events)


def test_refused_spec_change_is_a_condition_and_one_event():
    refused = ("False", "ImmutableFieldChanged", "the running job cannot absorb a change of spec.model.dim")
    d = derive(ts(generation=4), job(("Running", T0)), RUNNING_PODS, T1, refused)
    cond = next(c for c in d.status["conditions"] if c["type"] == "SpecAccepted")
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("False", "ImmutableFieldChanged", 4)
    assert d.status["phase"] == "Running"  # the job runs on, untouched
    assert [e.reason for e in d.events if e.type == "Warning"] == ["ImmutableFieldChanged"]
    again = derive(ts(d.status, generation=4), job(("Running", T0)), RUNNING_PODS, T2, refused)
    assert not any(e.reason == "ImmutableFieldChanged" for e in again.events)


def test_pod_driven_refresh_keeps_spec_acceptance_and_generation():
    first = derive(ts(generation=2), job(("Running", T0)), RUNNING_PODS, T1, APPLIED).status
    later = derive(ts(first, generation=5), job(("Running", T0)), RUNNING_PODS, T2, None).status
    assert later["observedGeneration"] == 2  # only a reconcile acts on a new generation


def test_trainer_owned_fields_are_left_to_the_trainer():
    trainer = {"step": 50, "progress": "25.0%", "etaSeconds": 60, "tokensPerSecond": 1e5, "mfu": 0.4,
               "lastCheckpoint": {"step": 40, "uri": "s3://b/r/step-00000040/"},
               "trainerTime": {"productiveSeconds": 12.0}}
    status = derive(ts({**trainer, "phase": "Running"}), job(("Running", T0)), RUNNING_PODS, T1, None).status
    # a merge patch with any of these would overwrite what rank 0 wrote after this body was read
    assert not set(status) & set(trainer)


def test_job_condition_ignores_false_conditions():
    j = job(("Running", T0))
    j["status"]["conditions"].append({"type": "Failed", "status": "False", "lastTransitionTime": T2})
    assert job_condition(j) == "Running"


def test_goodput_counts_from_creation_through_suspend_and_stops_when_the_run_ended():
    created = {"metadata": {"name": "run", "namespace": "ml", "generation": 3, "creationTimestamp": T0}}
    d1 = derive({**ts(), **created}, None, [], T1, APPLIED)  # no job yet: a minute pending
    assert d1.status["goodputDetail"]["lostSeconds"]["pending"] == 60.0
    body = {**ts({**d1.status, "trainerTime": {"productiveSeconds": 30.0}}, suspend=True), **created}
    d2 = derive(body, job(("Running", T0)), RUNNING_PODS, T2, None)  # it was Pending until now
    assert d2.status["phase"] == "Suspended"
    assert (d2.status["goodputDetail"]["wallSeconds"], d2.status["goodput"]) == (120.0, 0.25)
    d3 = derive({**ts({**d2.status, "trainerTime": {"productiveSeconds": 30.0}}, suspend=True), **created},
                job(("Running", T0)), [], "2026-01-01T00:05:00Z", None)
    assert d3.status["goodputDetail"]["lostSeconds"]["suspended"] == 180.0
    assert d3.status["goodput"] == pytest.approx(30 / 300, abs=1e-4)
    done = derive({**ts({**d3.status, "phase": "Succeeded"}), **created}, job(("Succeeded", T2)), [],
                  "2026-01-01T01:00:00Z", None)
    assert not changed(d3.status | {"phase": "Succeeded"}, {k: done.status[k] for k in ("goodput", "goodputDetail")})


def test_a_goodput_ledger_that_only_moved_with_the_clock_is_written_once_a_minute_not_on_every_event():
    created = {"metadata": {"name": "run", "namespace": "ml", "generation": 3, "creationTimestamp": T0}}
    first = derive({**ts(), **created}, job(("Running", T0)), RUNNING_PODS, T1, APPLIED).status
    stored = {**ts(first), **created}
    # a pod event 4 s later: same phase and conditions, only the ledger moved
    soon = derive(stored, job(("Running", T0)), RUNNING_PODS, "2026-01-01T00:01:04Z", None).status
    assert soon["goodputDetail"] != first["goodputDetail"] and not changed(first, soon)
    # the operator's 15 s tick, three times: the ledger alone is not worth a write of the TrainingSpec yet
    for tick in ("2026-01-01T00:01:15Z", "2026-01-01T00:01:30Z", "2026-01-01T00:01:45Z"):
        assert not changed(first, derive(stored, job(("Running", T0)), RUNNING_PODS, tick, None).status)
    # a minute after the stored one it is written, and nothing was lost by skipping the writes before
    later = derive(stored, job(("Running", T0)), RUNNING_PODS, T2, None).status
    assert changed(first, later)
    assert later["goodputDetail"]["wallSeconds"] == 120.0
    # any other change goes out at once, with the ledger as it is now
    scaling = derive(stored, job(("Running", T0)), RUNNING_PODS[:1] + [pod("run-worker-1", "Pending")],
                     "2026-01-01T00:01:01Z", None).status
    assert scaling["phase"] == "Scaling" and changed(first, scaling)
    # a status without a ledger yet gets one
    assert changed({"phase": "Running"}, soon)


def test_a_failed_runs_surviving_pods_are_stopped_and_stopped_pods_are_kept():
    leaving = {"metadata": {"name": "run-worker-3", "deletionTimestamp": T1}, "status": {"phase": "Running"}}
    pods = [pod("run-worker-0", "Failed"), pod("run-worker-1"), pod("run-worker-2", "Pending"), leaving,
            pod("run-worker-4", "Succeeded")]
    assert pods_to_stop(job(("Running", T0), ("Failed", T1)), pods) == ["run-worker-1", "run-worker-2"]
    # a succeeded, running, restarting or suspended job: its pods are the training-operator's to manage
    for conditions in [(("Running", T0), ("Succeeded", T1)), (("Running", T0),), (("Running", T0), ("Restarting", T1)),
                       (("Running", T0), ("Suspended", T1))]:
        assert pods_to_stop(job(*conditions), pods) == []
    assert pods_to_stop(None, pods) == []


def test_a_suspended_runs_status_is_complete_before_the_training_operator_marks_its_job():
    # The reconcile writes the status of a new suspended run from the job it just applied (no status yet);
    # the training-operator's "suspended" condition that follows changes nothing a write would carry.
    applied = derive(ts(suspend=True), {"spec": {"runPolicy": {"suspend": True}}}, [], T1, APPLIED).status
    assert applied["phase"] == "Suspended"
    marked = derive(ts(applied, suspend=True), job(("Created", T1), ("Suspended", T1)), [], T1, None)
    assert not changed(applied, marked.status) and marked.events == []
    # a running run being suspended: its Suspended condition does not carry the stale "running" message
    stopping = derive(ts(suspend=True), job(("Running", T0)), RUNNING_PODS, T1, APPLIED).status
    suspended = next(c for c in stopping["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True" and suspended["message"] == "phase Suspended"
