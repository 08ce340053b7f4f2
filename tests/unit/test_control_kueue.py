"""kiln.control.kueue: a Workload's conditions → the run's phase Queued, condition Queued, status.queue (pure)."""

from __future__ import annotations

from kiln.api.spec import TOPOLOGY_DOMAINS_MAX, TrainingSpecStatus
from kiln.control import kueue
from kiln.control.status import derive

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"
INSUFFICIENT = ("couldn't assign flavors to pod set worker: insufficient quota for nvidia.com/gpu in flavor "
                "rig-h200, previously considered podsets requests (0) + current podset request (8) > maximum capacity (8)")


def job(suspend: bool | None, queue: str | None = "team", conditions: tuple = ()) -> dict:
    labels = {kueue.QUEUE_LABEL: queue} if queue else {}
    run_policy = {} if suspend is None else {"suspend": suspend}
    return {"metadata": {"name": "run", "namespace": "ml", "uid": "u-1", "labels": labels},
            "spec": {"runPolicy": run_policy, "pytorchReplicaSpecs": {"Worker": {"replicas": 1}}},
            "status": {"conditions": [{"type": t, "status": "True", "lastTransitionTime": when}
                                      for t, when in conditions]}}


def workload(*conditions: dict, admission: dict | None = None) -> dict:
    status: dict = {"conditions": list(conditions)}
    if admission:
        status["admission"] = admission
    return {"metadata": {"name": "pytorchjob-run-abcde"}, "status": status}


def cond(ctype: str, status: str, reason: str, message: str = "", when: str = T1) -> dict:
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": when}


ADMISSION = {"clusterQueue": "gpus", "podSetAssignments": [{"name": "worker", "count": 1,
                                                            "flavors": {"nvidia.com/gpu": "rig-h200", "cpu": "rig-h200"}}]}


def ts(status: dict | None = None) -> dict:
    return {"metadata": {"name": "run", "namespace": "ml", "generation": 1},
            "spec": {"suspend": False, "scheduling": {"queue": "team"}}, "status": status or {}}


def test_waiting_for_quota_shows_kueues_reason_and_message():
    state = kueue.queue_state(job(True), workload(cond("QuotaReserved", "False", "Pending", INSUFFICIENT)))
    assert (state.admitted, state.reason, state.message) == (False, "Pending", INSUFFICIENT)
    d = derive(ts(), job(True, conditions=(("Created", T0), ("Suspended", T0))), [], T1, None, state)
    assert d.status["phase"] == "Queued"
    queued = next(c for c in d.status["conditions"] if c["type"] == "Queued")
    assert (queued["status"], queued["reason"], queued["message"]) == ("True", "Pending", INSUFFICIENT)
    assert d.status["queue"] == {"name": "team"}
    assert any(e.reason == "Queued" and "insufficient quota" in e.message for e in d.events)


def test_admitted_records_when_where_and_flavor():
    admitted = workload(cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted", when=T1),
                        admission=ADMISSION)
    state = kueue.queue_state(job(False), admitted)
    assert state.admitted and state.admitted_at == T1 and state.flavors == ("rig-h200",)
    d = derive(ts({"phase": "Queued"}), job(False, conditions=(("Running", T1),)), [], T2, None, state)
    assert d.status["phase"] == "Running"
    assert d.status["queue"] == {"name": "team", "admittedAt": T1, "clusterQueue": "gpus", "flavors": ["rig-h200"]}
    queued = next(c for c in d.status["conditions"] if c["type"] == "Queued")
    assert (queued["status"], queued["reason"]) == ("False", "Admitted")


def test_preempted_run_is_queued_with_reason_preempted():
    evicted = workload(cond("Admitted", "False", "NoReservation"),
                       cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to "
                            "prioritization in the ClusterQueue"))
    state = kueue.queue_state(job(True), evicted)
    assert (state.admitted, state.reason) == (False, "Preempted")
    # Kueue suspended the running job: the training-operator may not have noticed yet
    d = derive(ts({"phase": "Running"}), job(True, conditions=(("Running", T0),)), [], T1, None, state)
    assert d.status["phase"] == "Queued"
    assert next(c for c in d.status["conditions"] if c["type"] == "Queued")["reason"] == "Preempted"


def test_no_workload_yet_says_what_it_waits_for():
    state = kueue.queue_state(job(True), None)
    assert state.reason == "NoWorkload" and "LocalQueue team" in state.message
    # a Workload Kueue has not judged yet: kiln's own reason, never mistaken for one of Kueue's
    state = kueue.queue_state(job(True), workload())
    assert state.reason == "WaitingForKueue" and not state.admitted


def test_a_job_without_a_queue_is_not_kueues():
    assert kueue.queue_state(job(None, queue=None), workload()) is None
    assert not kueue.needs_read(job(None, queue=None), {})
    # suspended by someone else than a queue: Pending as before
    plain = job(True, queue=None, conditions=(("Created", T0), ("Suspended", T0)))
    assert derive(ts(), plain, [], T1, None).status["phase"] == "Pending"


def test_reads_while_held_and_once_after_admission_only():
    assert kueue.needs_read(job(True), {"phase": "Queued"})
    assert kueue.needs_read(job(None), {"phase": "Queued"})  # just admitted: record when
    assert not kueue.needs_read(job(None), {"phase": "Running", "queue": {"name": "team", "admittedAt": T1}})
    assert kueue.needs_read(job(True), {"phase": "Running", "queue": {"name": "team", "admittedAt": T1}})  # preempted


def test_status_without_a_read_keeps_the_queue_fields():
    old = {"phase": "Running", "queue": {"name": "team", "admittedAt": T1},
           "conditions": [cond("Queued", "False", "Admitted", "admitted")]}
    d = derive(ts(old), job(None, conditions=(("Running", T1),)), [], T2, None, None)
    assert "queue" not in d.status  # merge patch: the stored one stays
    assert next(c for c in d.status["conditions"] if c["type"] == "Queued")["reason"] == "Admitted"


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
FLAVOR_TOLERATION = {"key": "pool", "operator": "Equal", "value": "racks", "effect": "NoSchedule"}


def with_tolerations(body: dict, *tolerations: dict) -> dict:
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] = {"spec": {"containers": [{"name": "pytorch"}],
                                                                         "tolerations": list(tolerations)}}
    return body


def tolerations(body: dict) -> list[dict]:
    return body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["tolerations"]


def test_kilns_apply_keeps_the_tolerations_kueue_added_at_admission():
    desired = with_tolerations(job(None), GPU_TOLERATION)
    admitted = with_tolerations(job(False), GPU_TOLERATION, FLAVOR_TOLERATION)
    assert tolerations(kueue.with_admitted_tolerations(desired, admitted)) == [GPU_TOLERATION, FLAVOR_TOLERATION]
    assert tolerations(desired) == [GPU_TOLERATION]  # the plan's own object is left as it was
    # held (Kueue restores the templates when it suspends), not queued, another job, none: kiln's own only
    for live in (with_tolerations(job(True), GPU_TOLERATION, FLAVOR_TOLERATION),
                 with_tolerations(job(False, queue=None), GPU_TOLERATION, FLAVOR_TOLERATION),
                 {**admitted, "metadata": {**admitted["metadata"], "name": "other"}}, None):
        assert kueue.with_admitted_tolerations(desired, live) == desired


def test_admitted_under_a_topology_records_the_domains_kueue_placed_it_in():
    hosts = {"levels": ["kubernetes.io/hostname"], "slices": [
        {"domainCount": 2, "valuesPerLevel": [{"individual": {"prefix": "kwok-topo-b0-r", "roots": ["0-h0", "0-h1"]}}],
         "podCounts": {"universal": 1}}]}
    admission = {**ADMISSION, "podSetAssignments": [{**ADMISSION["podSetAssignments"][0], "topologyAssignment": hosts}]}
    admitted = workload(cond("Admitted", "True", "Admitted"), admission=admission)
    status = kueue.queue_state(job(False), admitted).as_status()
    assert status["topology"] == {"levels": ["kubernetes.io/hostname"],
                                  "domains": ["kwok-topo-b0-r0-h0", "kwok-topo-b0-r0-h1"]}
    assert TrainingSpecStatus.model_validate({"queue": status}).queue.topology.domains == status["topology"]["domains"]
    # several levels, a value shared by the slice (universal) and one per domain with a suffix
    racks = {"levels": ["rack", "host"], "slices": [
        {"domainCount": 2, "valuesPerLevel": [{"universal": "b1-r0"}, {"individual": {"roots": ["h0", "h1"],
                                                                                      "suffix": ".rig"}}]},
        {"domainCount": 1, "valuesPerLevel": [{"universal": "b1-r1"}, {"universal": "h7.rig"}]}]}
    assert kueue.topology_domains({"podSetAssignments": [{"topologyAssignment": racks}]}) == (
        ("rack", "host"), ("b1-r0/h0.rig", "b1-r0/h1.rig", "b1-r1/h7.rig"))
    # no topology (a flavor without one): no field; more domains than status holds: the first ones
    assert "topology" not in kueue.queue_state(job(False), workload(cond("Admitted", "True", "Admitted"),
                                                                    admission=ADMISSION)).as_status()
    many = kueue.QueueState("team", True, "Admitted", "", topology_levels=("h",),
                            topology_domains=tuple(f"n{i}" for i in range(TOPOLOGY_DOMAINS_MAX + 5)))
    assert len(many.as_status()["topology"]["domains"]) == TOPOLOGY_DOMAINS_MAX
