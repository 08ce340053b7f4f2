"""elastic.faultTolerance replicaGroups on Kubernetes: plan() renders the torchft lighthouse and one
PyTorchJob per replica group; status shows each group and counts its restarts (kiln.control.status)."""

from __future__ import annotations

import copy

import pytest
import yaml

from kiln.api import contract
from kiln.api.load import parse
from kiln.api.spec import TrainingSpec
from kiln.errors import KilnError
from kiln.control.plan import (GROUP_LABEL, IMMUTABLE_WHILE_RUNNING, LIGHTHOUSE_LABEL, LIGHTHOUSE_PORT, RUN_LABEL,
                               Observed, dump, job_names, job_names_of, plan, resolve)
from kiln.api.spec import TrainingSpecStatus
from kiln.control import kueue, replica_groups
from kiln.control.replica_groups import combined_job
from kiln.control.status import derive

from tests.support.groups import CONFIG, GROUPS, UID, of, rendered  # noqa: F401



def env(job: dict) -> dict:
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_one_pytorchjob_per_group_each_a_fixed_share_of_the_nodes_told_its_group_and_the_lighthouse():
    jobs = of(rendered(), "PyTorchJob")
    assert [j["metadata"]["name"] for j in jobs] == ["ft-g0", "ft-g1"] == job_names("ft", 2)
    for group, job in enumerate(jobs):
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        assert worker["replicas"] == 2  # 4 nodes / 2 groups
        assert job["spec"]["elasticPolicy"]["minReplicas"] == job["spec"]["elasticPolicy"]["maxReplicas"] == 2
        assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 2  # gang: the group's pods
        assert env(job)[contract.FT_GROUP] == str(group)
        assert env(job)[contract.FT_LIGHTHOUSE] == f"http://ft-lighthouse:{LIGHTHOUSE_PORT}"
        labels = worker["template"]["metadata"]["labels"]
        assert labels[RUN_LABEL] == "ft" and labels[GROUP_LABEL] == str(group)
        assert job["metadata"]["labels"][GROUP_LABEL] == str(group)
        # every group runs the one resolved spec (the trainer takes its group's share: kiln.api.layout)
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][0]["configMap"] == \
            {"name": "ft-spec"}
    assert not any(j["metadata"]["name"] == "ft" for j in jobs)  # no job of the whole run beside the groups


def test_the_lighthouse_is_a_deployment_and_service_from_the_trainer_image_reachable_only_from_the_run():
    objects = rendered()
    [deployment], [service] = of(objects, "Deployment"), of(objects, "Service")
    policies = {p["metadata"]["name"]: p for p in of(objects, "NetworkPolicy")}
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "ft-lighthouse"
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "registry.test/trainer:1"
    assert container["command"][:3] == ["kiln-lighthouse", "--min_replicas", "1"]
    assert f"[::]:{LIGHTHOUSE_PORT}" in container["command"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    selector = {LIGHTHOUSE_LABEL: "ft"}
    assert deployment["spec"]["selector"]["matchLabels"] == selector == service["spec"]["selector"]
    assert service["spec"]["ports"][0]["port"] == LIGHTHOUSE_PORT
    # not a pod of the run: status, the elastic loop and the pod watch count the run's pods by RUN_LABEL
    assert RUN_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    # Pod Security restricted, as the trainer
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"]["memory"]  # never BestEffort
    # no GPU: neither the GPU product selector nor the GPU toleration; the spec's own pools, when it names some
    assert "nodeSelector" not in pod and "tolerations" not in pod
    pooled = copy.deepcopy(GROUPS)
    pooled["spec"]["resources"].update(nodeSelector={"pool": "train"},
                                       tolerations=[{"key": "team", "operator": "Exists", "effect": "NoSchedule"}])
    [lh] = of(rendered(pooled), "Deployment")
    assert lh["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "train"}
    assert lh["spec"]["template"]["spec"]["tolerations"] == [{"key": "team", "operator": "Exists",
                                                               "effect": "NoSchedule"}]
    # the lighthouse admits only the run's trainer pods, on its port; the trainers admit every pod of the run,
    # which is every group (groups reach each other: gradients, the managers' stores, heals from a peer)
    run = {"podSelector": {"matchLabels": {RUN_LABEL: "ft"}}}
    assert policies["ft-lighthouse"]["spec"]["podSelector"] == {"matchLabels": selector}
    assert policies["ft-lighthouse"]["spec"]["ingress"] == [
        {"from": [run], "ports": [{"protocol": "TCP", "port": LIGHTHOUSE_PORT}]}]
    assert policies["ft-trainer"]["spec"]["podSelector"] == {"matchLabels": {RUN_LABEL: "ft"}}
    assert {"from": [run]} in policies["ft-trainer"]["spec"]["ingress"]


def test_every_object_is_owned_by_the_run_and_the_lighthouse_comes_before_the_jobs():
    objects = rendered()
    for obj in objects:
        assert obj["metadata"]["ownerReferences"][0]["uid"] == UID, obj["kind"]
        assert obj["metadata"]["namespace"] == "ml"
    kinds = [o["kind"] for o in objects]
    assert kinds.index("Deployment") < kinds.index("PyTorchJob")
    assert kinds[-2:] == ["PyTorchJob", "PyTorchJob"]


def test_mode_off_renders_one_job_as_before():
    off = copy.deepcopy(GROUPS)
    off["spec"]["elastic"]["faultTolerance"]["mode"] = "off"
    objects = rendered(off)
    assert [o["metadata"]["name"] for o in of(objects, "PyTorchJob")] == ["ft"] == job_names_of(off)
    assert not of(objects, "Deployment") and not of(objects, "Service")
    assert not {contract.FT_GROUP, contract.FT_LIGHTHOUSE} & set(env(of(objects, "PyTorchJob")[0]))
    assert job_names_of(GROUPS) == ["ft-g0", "ft-g1"]


@pytest.mark.parametrize("change, field", [
    ({"resources": {"nodes": 3, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}, "parallelism": {"tensor": 1}},
     "spec.elastic.faultTolerance.groups: with elastic.faultTolerance.mode replicaGroups, elastic.faultTolerance."
     "groups must divide resources.nodes"),
    ({"elastic": {"minNodes": 2, "faultTolerance": {"mode": "replicaGroups", "groups": 2}}},
     "spec.elastic.faultTolerance: elastic.minNodes, elastic.maxNodes (other than resources.nodes) and elastic.plan"),
    ({"elastic": {"plan": [{"untilStep": 10, "nodes": 4}, {"nodes": 4}],
                  "faultTolerance": {"mode": "replicaGroups", "groups": 2}}}, "got a plan of 2 entries"),
])
def test_groups_the_operator_cannot_render_are_refused_by_validate_and_by_plan_with_the_same_line(change, field):
    raw = copy.deepcopy(GROUPS)
    raw["spec"].update(change)
    if "resources" in change:
        raw["spec"]["training"]["globalBatchSize"] = 48  # dp 24, groups 2 divide it: only the node rule fails
    with pytest.raises(KilnError) as validate:  # kiln validate
        parse(copy.deepcopy(raw), scope="all")
    assert field in str(validate.value) and str(validate.value).count("spec.") == 1  # that rule alone
    with pytest.raises(KilnError) as planned:  # the operator, behind a CRD without the rules: InvalidSpec
        plan(TrainingSpec.model_validate(copy.deepcopy(raw)), None, CONFIG)
    assert str(planned.value) == str(validate.value)
    parse(copy.deepcopy(raw), scope="local")  # kiln run: one machine, no jobs per group, no node elasticity


def test_groups_at_a_fixed_size_equal_to_the_nodes_are_accepted():
    raw = copy.deepcopy(GROUPS)
    raw["spec"]["elastic"].update(minNodes=4, maxNodes=4)  # the same as resources.nodes: still a fixed size
    assert len(of(rendered(raw), "PyTorchJob")) == 2


def test_switching_fault_tolerance_under_a_running_job_is_refused():
    assert ("elastic", "faultTolerance") in IMMUTABLE_WHILE_RUNNING
    off = copy.deepcopy(GROUPS)
    off["spec"]["elastic"]["faultTolerance"]["mode"] = "off"
    applied = dump(resolve(parse(copy.deepcopy(off)), CONFIG))
    result = plan(parse(copy.deepcopy(GROUPS)), Observed(applied=applied, job_active=True), CONFIG)
    assert result.objects == [] and "spec.elastic.faultTolerance.mode" in result.refused


# ---- status ----

TS = {"metadata": {"name": "ft", "namespace": "ml", "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z"},
      "spec": GROUPS["spec"], "status": {}}


def job(group: int, state: str | None, replicas: int = 1) -> dict:
    conditions = [{"type": "Created", "status": "True", "lastTransitionTime": "2026-01-01T00:00:01Z"}]
    if state:
        conditions.append({"type": state, "status": "True", "lastTransitionTime": "2026-01-01T00:00:02Z"})
    return {"metadata": {"name": f"ft-g{group}", "resourceVersion": str(10 + group)},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": replicas}}}, "status": {"conditions": conditions}}


def pod(group: int, phase: str = "Running", deleting: bool = False) -> dict:
    meta = {"name": f"ft-g{group}-worker-0", "labels": {RUN_LABEL: "ft", GROUP_LABEL: str(group)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:03Z"
    return {"metadata": meta, "status": {"phase": phase}}


def refresh(status: dict, jobs: list[dict | None], pods: list[dict], now: str):
    ts = {**TS, "status": status}
    return derive(ts, combined_job(jobs), pods, now, group_jobs=jobs)


def test_status_shows_each_group_and_a_lost_group_while_the_run_keeps_running():
    jobs = [job(0, "Running"), job(1, "Running")]
    up = refresh({}, jobs, [pod(0), pod(1)], "2026-01-01T00:01:00Z")
    assert up.status["phase"] == "Running" and up.status["nodes"] == 2
    assert up.status["replicaGroups"] == [
        {"group": 0, "job": "ft-g0", "phase": "Running", "pods": 1, "restarts": 0},
        {"group": 1, "job": "ft-g1", "phase": "Running", "pods": 1, "restarts": 0}]
    # group 1's pod is being deleted (a node lost, a kill): the run runs on, group 1 restarts alone
    lost = refresh(up.status, jobs, [pod(0), pod(1, deleting=True)], "2026-01-01T00:01:10Z")
    assert lost.status["phase"] == "Running" and lost.status["restarts"] == 0
    assert lost.status["replicaGroups"][1] == {"group": 1, "job": "ft-g1", "phase": "Restarting", "pods": 0,
                                               "restarts": 1}
    assert [e.reason for e in lost.events] == ["ReplicaGroupLost"]
    # the training-operator's new pod pending, then running: one restart counted, not two
    pending = refresh(lost.status, jobs, [pod(0), pod(1, "Pending")], "2026-01-01T00:01:20Z")
    assert pending.status["replicaGroups"][1]["restarts"] == 1 and not pending.events
    back = refresh(pending.status, jobs, [pod(0), pod(1)], "2026-01-01T00:01:30Z")
    assert back.status["replicaGroups"][1] == {"group": 1, "job": "ft-g1", "phase": "Running", "pods": 1,
                                               "restarts": 1}
    assert [e.reason for e in back.events] == ["ReplicaGroupBack"]


def test_the_run_ends_when_every_group_has_ended_and_restarts_when_every_group_does():
    assert combined_job([None, None]) is None
    state = lambda jobs: derive(TS, combined_job(jobs), [], "2026-01-01T00:01:00Z", group_jobs=jobs).status["phase"]
    assert state([job(0, "Succeeded"), job(1, "Running")]) == "Running"
    assert state([job(0, "Succeeded"), job(1, "Failed")]) == "Succeeded"
    assert state([job(0, "Failed"), job(1, "Failed")]) == "Failed"
    assert state([job(0, "Restarting"), job(1, "Restarting")]) == "Restarting"
    assert state([job(0, "Failed"), job(1, "Restarting")]) == "Restarting"
    assert state([job(0, None), job(1, None)]) == "Pending"
    assert state([job(0, "Failed"), None]) == "Pending"  # a group's job being made again: not over


def test_replica_group_status_fields_are_the_operators():
    jobs = [job(0, "Running"), job(1, "Running")]
    status = refresh({}, jobs, [pod(0), pod(1)], "2026-01-01T00:01:00Z").status
    assert set(status) <= contract.OPERATOR_STATUS
    assert yaml.safe_dump(status)  # plain data, ready for a merge patch


def test_a_groups_pods_get_only_variables_the_trainer_reads():
    from pathlib import Path

    import kiln.trainer

    for job in of(rendered(), "PyTorchJob"):
        ft_env = {name for name in env(job) if name.startswith("KILN_FT_")}
        assert ft_env == set(contract.FT_POD_ENV)
    ft_source = (Path(kiln.trainer.__file__).parent / "membership" / "replica_groups.py").read_text()
    assert all(f"os.environ.get(contract.{name}" in ft_source for name in ("FT_LIGHTHOUSE", "FT_GROUP"))


# ---- the trainer's side (kiln.trainer.observe.status_report) and the goodput ledger (kiln.control.goodput) ----

def ft_record(step: int, live: int, replica_rank: int = 0, step_s: float = 1.0) -> dict:
    return {"step": step, "step_s": step_s, "ft_group": replica_rank, "ft_groups": 2, "ft_replica_rank": replica_rank,
            "ft_participants": live, "ft_quorum_id": 4 + (live == 1), "ft_quorum_changes": int(live == 1),
            "ft_heals": 0}


class FakeSender:
    """Collects what a StatusReporter would patch (a real StatusSender needs an apiserver)."""

    def __init__(self):
        self.bodies: list[dict] = []

    def submit(self, body: dict) -> None:
        self.bodies.append(body)

    def close(self) -> None:
        pass


def test_only_the_group_at_replica_rank_0_reports_and_it_counts_degraded_steps():
    from kiln.trainer.observe.status_report import StatusReporter

    clock = iter(range(100)).__next__
    writer, other = FakeSender(), FakeSender()
    r0 = StatusReporter(100, sender=writer, every_s=0.0, clock=clock)
    r1 = StatusReporter(100, sender=other, every_s=0.0, clock=clock)
    for step, live in ((1, 2), (2, 1), (3, 1), (4, 2)):
        r0.update(ft_record(step, live, replica_rank=0), None)
        r1.update(ft_record(step, live, replica_rank=1), None)
    r0.close(None)
    r1.close(None)
    # two writers of trainerTime a little apart would read to the operator as a trainer that went back
    assert other.bodies == [] and len(writer.bodies) == 5
    last = writer.bodies[-1]["status"]
    assert last["trainerTime"]["productiveSeconds"] == 4.0 and last["trainerTime"]["degradedSeconds"] == 2.0
    assert last["quorum"] == {"id": 4, "liveGroups": 2, "groups": 2, "changes": 0, "heals": 0}
    assert writer.bodies[1]["status"]["quorum"]["liveGroups"] == 1
    # carried across a restart in the checkpoint's goodput counters
    assert StatusReporter(100, restored={"step": 4, "goodput": r0.state_dict()}).state_dict()["degraded_s"] == 2.0
    # a run without replica groups reports no degraded counter and no quorum
    plain = FakeSender()
    r = StatusReporter(100, sender=plain, every_s=0.0, clock=clock)
    r.update({"step": 1, "step_s": 1.0}, None)
    assert "degradedSeconds" not in plain.bodies[0]["status"]["trainerTime"] and "quorum" not in plain.bodies[0]["status"]


def test_the_ledger_counts_degraded_stepping_inside_productive_time_apart_from_stopped_time():
    from kiln.control.goodput import Ledger, observe

    def reported(productive: float, degraded: float) -> dict:
        return {"productiveSeconds": productive, "checkpointStallSeconds": 0.0, "rollbackSeconds": 0.0,
                "degradedSeconds": degraded}

    g = Ledger(observed_at=0.0)
    g = observe(g, 100.0, "Running", reported(90.0, 0.0))  # both groups stepping
    g = observe(g, 200.0, "Running", reported(185.0, 60.0))  # group 1 restarting alone: the other steps on
    g = observe(g, 260.0, "Restarting", reported(185.0, 60.0))  # every group down: nothing steps
    assert (g.productive_s, g.degraded_s, g.lost_s["restart"]) == (185.0, 60.0, 60.0)
    detail = g.as_status()["goodputDetail"]
    assert detail["degradedSeconds"] == 60.0 and detail["lostSeconds"]["restart"] == 60.0
    assert Ledger.from_status(g.as_status(), 0.0).degraded_s == 60.0  # an operator restart continues the account
    # degraded time is never more than the productive time credited with it (no time is invented)
    h = observe(Ledger(observed_at=0.0), 10.0, "Running", reported(5.0, 50.0))
    assert h.productive_s == 5.0 and h.degraded_s == 5.0


def test_kiln_status_shows_each_group_and_the_last_quorum():
    from kiln.cli.cluster_cmds import group_table, plain_table

    jobs = [job(0, "Running"), job(1, "Running")]
    lost = refresh(refresh({}, jobs, [pod(0), pod(1)], "2026-01-01T00:01:00Z").status, jobs,
                   [pod(0), pod(1, "Failed")], "2026-01-01T00:01:10Z").status
    lost["quorum"] = {"id": 5, "liveGroups": 1, "groups": 2, "changes": 1, "heals": 0}
    text = plain_table(*group_table({"status": lost}))
    assert "QUORUM 5: 1 OF 2 LIVE, 1 CHANGE(S), 0 HEAL(S)" in text
    rows = [line.split() for line in text.splitlines()[1:]]
    assert rows == [["0", "ft-g0", "Running", "1", "0"], ["1", "ft-g1", "Restarting", "0", "1"]]
    assert group_table({"status": {"phase": "Running"}}) is None  # a run without replica groups: no table


class FakeKube:
    """The two reads `kiln logs` makes (pods of a run, a pod's log), from dicts: no apiserver here."""

    def __init__(self, pods: dict[str, dict], logs: dict[str, str]):
        self._pods, self._logs = pods, logs

    def pods(self, namespace: str, run: str) -> list[dict]:
        return [{"metadata": {"name": name, "labels": labels}} for name, labels in self._pods.items()]

    def logs(self, namespace: str, pod: str, tail: int | None = None) -> str:
        return self._logs.get(pod, "")


def test_kiln_logs_reads_a_replica_groups_pods():
    from kiln.client import job_of, worker_logging_steps

    grouped = FakeKube({f"ft-g{g}-worker-{w}": {RUN_LABEL: "ft", GROUP_LABEL: str(g)} for g in (0, 1) for w in (0, 1)},
                       {"ft-g1-worker-1": "kiln: ft: group 1 ...\nstep 7/100  loss 2.1\n"})
    assert job_of(grouped, "ml", "ft", None) == "ft-g0" and job_of(grouped, "ml", "ft", 1) == "ft-g1"
    assert worker_logging_steps(grouped, "ml", "ft", "ft-g1") == 1  # the worker holding the group's rank 0
    plain = FakeKube({"run-worker-0": {RUN_LABEL: "run"}}, {})
    assert job_of(plain, "ml", "run", None) == "run"


# ---- under Kueue: one Workload per group's PyTorchJob, each admitted alone (kiln.control.kueue) ----

QUOTA = "couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in flavor rig-h200"


def queued_job(group: int, state: str | None, held: bool) -> dict:
    body = job(group, state)
    body["metadata"] |= {"namespace": "ml", "uid": f"uid-g{group}", "labels": {kueue.QUEUE_LABEL: "team"}}
    body["spec"]["runPolicy"] = {"suspend": held}
    return body


def waiting(message: str = QUOTA, reason: str = "Pending") -> dict:
    return {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": reason,
                                       "message": message}]}}


def admitted(when: str) -> dict:
    return {"status": {"conditions": [{"type": "Admitted", "status": "True", "lastTransitionTime": when}],
                       "admission": {"clusterQueue": "gpus", "podSetAssignments": [
                           {"name": "worker", "flavors": {"nvidia.com/gpu": "rig-h200"}}]}}}


class FakeKueueApi:
    """The Workload list the operator makes (kube.custom), from dicts by job uid; counts the reads."""

    def __init__(self, workloads: dict[str, dict]):
        self.workloads, self.reads = workloads, []

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector):
        uid = label_selector.split("=", 1)[1]
        self.reads.append(uid)
        found = self.workloads.get(uid)
        return {"items": [{"metadata": {"name": f"wl-{uid}", "creationTimestamp": T1}, **found}] if found else []}


class FakeWorkloadKube:
    """kiln.control.kube.Kube's Workload reads only (no apiserver here)."""

    def __init__(self, workloads: dict[str, dict]):
        self.custom = FakeKueueApi(workloads)


def queue_refresh(status: dict, jobs: list[dict], pods: list[dict], workloads: dict[str, dict], now: str):
    """One status refresh as kiln.control.sync._write_status makes it: the Workload reads due, then derive."""
    kube = FakeWorkloadKube(workloads)
    queues = replica_groups.observe_groups(kube, jobs, status)
    ts = {**TS, "spec": {**GROUPS["spec"], "scheduling": {"queue": "team"}}, "status": status}
    return derive(ts, combined_job(jobs), pods, now, group_jobs=jobs, group_queues=queues), kube.custom.reads


def queued_condition(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Queued")


T1, T2 = "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"


def test_under_kueue_the_run_runs_once_one_group_is_admitted_and_says_which_groups_still_wait():
    # no group admitted: the run is Queued, every group waits with Kueue's reason
    held = [queued_job(0, "Suspended", True), queued_job(1, "Suspended", True)]
    both = {"uid-g0": waiting(), "uid-g1": waiting()}
    d, reads = queue_refresh({}, held, [], both, T1)
    assert d.status["phase"] == "Queued" and reads == ["uid-g0", "uid-g1"]
    cond = queued_condition(d.status)
    assert (cond["status"], cond["reason"]) == ("True", "Pending")
    assert "group(s) 0, 1 of 2 wait in LocalQueue team" in cond["message"] and QUOTA in cond["message"]
    assert [(g["queued"], g["queueReason"], g["queueMessage"]) for g in d.status["replicaGroups"]] == \
        [(True, "Pending", QUOTA)] * 2
    assert [g["phase"] for g in d.status["replicaGroups"]] == ["Pending", "Pending"]
    assert d.status["queue"] == {"name": "team", "waitingGroups": [0, 1]}

    # group 0 admitted and running, group 1 still waits: the run Runs (torchft trains with one group),
    # condition Queued is False but names the waiting group and why
    part = [queued_job(0, "Running", False), queued_job(1, "Suspended", True)]
    d, reads = queue_refresh(d.status, part, [pod(0)], {"uid-g0": admitted(T1), "uid-g1": waiting()}, T2)
    assert d.status["phase"] == "Running" and reads == ["uid-g0", "uid-g1"]
    cond = queued_condition(d.status)
    assert (cond["status"], cond["reason"]) == ("False", replica_groups.PARTLY_ADMITTED)
    assert "group(s) 1 of 2 wait" in cond["message"] and "ft-g1" in cond["message"] and QUOTA in cond["message"]
    assert [e.reason for e in d.events if e.reason == "Queued"] == ["Queued"]
    g0, g1 = d.status["replicaGroups"]
    assert (g0["phase"], g0["queued"], g0["queueReason"], g0["admittedAt"]) == ("Running", False, "Admitted", T1)
    assert (g1["phase"], g1["queued"], g1["queueReason"]) == ("Pending", True, "Pending") and "admittedAt" not in g1
    assert d.status["queue"] == {"name": "team", "admittedAt": T1, "clusterQueue": "gpus", "flavors": ["rig-h200"],
                                 "waitingGroups": [1]}

    # the next refresh reads only the waiting group's Workload; the admitted group's state is kept as recorded
    again, reads = queue_refresh(d.status, part, [pod(0)], {"uid-g0": admitted(T1), "uid-g1": waiting()}, T2)
    assert reads == ["uid-g1"] and again.status["queue"] == d.status["queue"]
    assert again.status["replicaGroups"] == d.status["replicaGroups"] and not again.events
    assert queued_condition(again.status) == cond

    # group 1 admitted too: nothing waits; once both run, a refresh reads no Workload at all
    up = [queued_job(0, "Running", False), queued_job(1, "Running", False)]
    d, reads = queue_refresh(again.status, up, [pod(0), pod(1)], {"uid-g0": admitted(T1), "uid-g1": admitted(T2)}, T2)
    assert reads == ["uid-g1"]
    cond = queued_condition(d.status)
    assert (cond["status"], cond["reason"]) == ("False", "Admitted")
    assert d.status["queue"]["waitingGroups"] == [] and d.status["queue"]["admittedAt"] == T1  # the first group's
    assert [(g["queued"], g["admittedAt"]) for g in d.status["replicaGroups"]] == [(False, T1), (False, T2)]
    steady, reads = queue_refresh(d.status, up, [pod(0), pod(1)], {}, T2)
    assert reads == [] and "queue" not in steady.status  # merge patch: the stored one stays
    assert steady.status["replicaGroups"] == d.status["replicaGroups"]
    assert TrainingSpecStatus.model_validate(d.status).replica_groups[1].queue_reason == "Admitted"


def test_a_preempted_group_waits_again_while_the_others_train_on():
    up = [queued_job(0, "Running", False), queued_job(1, "Running", False)]
    d, _ = queue_refresh({}, up, [pod(0), pod(1)], {"uid-g0": admitted(T1), "uid-g1": admitted(T1)}, T1)
    # Kueue evicts group 1 (a higher-priority workload): it suspends the group's job, its pod goes
    evicted = {"status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "Preempted",
                                          "message": "Preempted to accommodate a workload"}]}}
    jobs = [queued_job(0, "Running", False), queued_job(1, "Running", True)]
    d, reads = queue_refresh(d.status, jobs, [pod(0)], {"uid-g0": admitted(T1), "uid-g1": evicted}, T2)
    assert reads == ["uid-g1"] and d.status["phase"] == "Running"
    g1 = d.status["replicaGroups"][1]
    assert (g1["phase"], g1["queued"], g1["queueReason"], g1["admittedAt"]) == ("Pending", True, "Preempted", T1)
    cond = queued_condition(d.status)
    assert cond["reason"] == replica_groups.PARTLY_ADMITTED and "Preempted" in cond["message"]
    assert {e.reason for e in d.events} == {"Queued", "ReplicaGroupLost"}
    # every group held: the run as a whole is Queued again
    both = [queued_job(0, "Running", True), queued_job(1, "Running", True)]
    d, _ = queue_refresh(d.status, both, [], {"uid-g0": evicted, "uid-g1": evicted}, T2)
    assert d.status["phase"] == "Queued" and queued_condition(d.status)["reason"] == "Preempted"


def test_a_group_whose_job_is_not_there_counts_as_waiting():
    running = kueue.queue_state(queued_job(0, "Running", False), admitted(T1))
    state = replica_groups.groups_state([running, None], ["ft-g0", "ft-g1"], None)
    assert state.admitted and state.waiting_groups == (1,) and state.reason == replica_groups.PARTLY_ADMITTED
    assert "group 1 (ft-g1): its PyTorchJob is not made yet" in state.message
    assert replica_groups.groups_state([None, None], ["ft-g0", "ft-g1"], None) is None  # no queue: nothing of Kueue's


def test_groups_past_the_cap_are_refused_by_validate_and_the_crd_says_the_same():
    from kiln.api.crd import crd
    from kiln.api.spec import MAX_REPLICA_GROUPS

    raw = copy.deepcopy(GROUPS)
    raw["spec"]["elastic"]["faultTolerance"]["groups"] = MAX_REPLICA_GROUPS + 1
    with pytest.raises(Exception, match="elastic.faultTolerance.groups"):
        parse(raw)
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    groups = schema["properties"]["spec"]["properties"]["elastic"]["properties"]["faultTolerance"]["properties"]["groups"]
    assert groups["maximum"] == MAX_REPLICA_GROUPS == 4096


def test_a_plan_names_each_groups_job_once(monkeypatch):
    """plan() is linear in groups: before, each job rebuilt the list of every job's name (O(groups²) names;
    16,000 groups took 45 s of CPU). Counted, not timed: 64 groups build 64 names."""
    from kiln.control import names as names_module

    built = []
    real = names_module.group_job_name
    monkeypatch.setattr(names_module, "group_job_name", lambda run, group: built.append(group) or real(run, group))
    raw = copy.deepcopy(GROUPS)
    raw["spec"]["resources"]["nodes"] = 64
    raw["spec"]["training"]["globalBatchSize"] = 512  # dp = 64 nodes x 8 GPUs / tensor 2 = 256, micro 2
    raw["spec"]["elastic"]["faultTolerance"]["groups"] = 64
    jobs = of(rendered(raw), "PyTorchJob")
    assert [j["metadata"]["name"] for j in jobs] == [f"ft-g{i}" for i in range(64)]
    assert sorted(built) == list(range(64))
