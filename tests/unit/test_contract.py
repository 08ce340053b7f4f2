"""kiln.api.contract: the names the operator and the trainer share. The plan sets only variables the
trainer reads, each status field has exactly one writer, and conditions come from one list."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api import contract
from kiln.api.load import parse
from kiln.api.spec import TrainingSpecStatus
from kiln.control.plan import plan
from kiln.control.status import derive, set_condition
from kiln.trainer.observe.status_report import StatusReporter, status_patch

TRAINER_SOURCES = Path(contract.__file__).resolve().parents[1] / "trainer"
RUN = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "c", "namespace": "ml"},
       "spec": {"checkpoint": {"uri": "s3://ckpt/c/", "endpoint": "http://s3:9000", "credentialsSecret": "s3"}}}


def pod_of(objects: list[dict]) -> dict:
    job = next(o for o in objects if o["kind"] == "PyTorchJob")
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def test_every_status_field_has_exactly_one_writer():
    fields = {f.alias or name for name, f in TrainingSpecStatus.model_fields.items()}
    assert not contract.OPERATOR_STATUS & contract.TRAINER_STATUS
    assert contract.OPERATOR_STATUS | contract.TRAINER_STATUS == fields, \
        "a status field without its writer in kiln.api.contract (OPERATOR_STATUS or TRAINER_STATUS)"


def test_the_trainer_patches_only_its_own_status_fields():
    record = {"step": 7, "tokens_per_second": 1e4, "mfu": 0.3,  # a replica group's (kiln.trainer.membership.replica_groups) too
              "tracking_dropped": 2,  # a tracker's trouble (kiln.trainer.observe.tracking)
              "ft_quorum_id": 3, "ft_participants": 1, "ft_groups": 2, "ft_quorum_changes": 1, "ft_heals": 0}
    info = {"lastCheckpoint": {"step": 5, "uri": "s3://ckpt/c/step-00000005/", "time": 0.0}}
    body = status_patch(record, info, 100, seconds_per_step=1.0,
                        trainer_time={"productive_s": 1.0, "checkpoint_stall_s": 0.0, "rollback_s": 0.0},
                        gpu_health=[{"node": "n1", "state": "Healthy", "gpus": [{"index": 0, "state": "Healthy"}]}],
                        preflight={"checkedAt": "2026-01-01T00:00:00Z", "step": 0, "seconds": 0.1, "ranks": 1,
                                   "medianGflops": 1.0, "slow": []}, stragglers=[])
    # the step's patch carries every trainer field but the hang report, which its own patch carries
    # (kiln.trainer.observe.hang_report, from the hang watch's thread)
    sent = []
    StatusReporter(100, sender=type("Sender", (), {"submit": lambda self, b: sent.append(b)})()).hang({"step": 7})
    assert set(body["status"]) | set(sent[0]["status"]) == contract.TRAINER_STATUS
    assert set(sent[0]["status"]) == {"hang"}


def test_the_operator_writes_only_its_own_fields_and_listed_conditions():
    ts = {"metadata": {"name": "c", "namespace": "ml", "generation": 2, "creationTimestamp": "2026-01-01T00:00:00Z"},
          "spec": {"training": {"steps": 100}}, "status": {"phase": "Pending"}}
    job = {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1}}},
           "status": {"conditions": [{"type": "Running", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"}]}}
    pods = [{"metadata": {"name": "c-worker-0"}, "status": {"phase": "Running"}}]
    status = derive(ts, job, pods, "2026-01-01T00:02:00Z", ("True", "Applied", "ok")).status
    assert set(status) <= contract.OPERATOR_STATUS
    assert {c["type"] for c in status["conditions"]} <= set(contract.CONDITION_TYPES)
    with pytest.raises(ValueError, match="not one of kiln.api.contract.CONDITION_TYPES"):
        set_condition([], "Ready", "True", "Up", "", "2026-01-01T00:02:00Z", 2)


def test_the_plan_sets_only_variables_the_trainer_reads():
    pod = pod_of(plan(parse(RUN)).objects)
    container = pod["containers"][0]
    kiln_env = {e["name"] for e in container["env"] if e["name"].startswith("KILN_")}
    assert kiln_env <= set(contract.POD_ENV), \
        f"{sorted(kiln_env - set(contract.POD_ENV))}: add to kiln.api.contract.POD_ENV, with the trainer reading it"
    assert kiln_env == set(contract.POD_ENV)  # this spec (checkpoints to a store, metrics on) gets them all
    # each name has a reader on the trainer side, which reads it by the contract's name (KILN_SPEC had none)
    names = {value: name for name, value in vars(contract).items() if value in contract.POD_ENV}
    sources = "\n".join(p.read_text() for p in TRAINER_SOURCES.rglob("*.py"))
    unread = [var for var, name in names.items() if f"os.environ.get(contract.{name}" not in sources]
    assert not unread, f"set by the plan, read by no trainer module: {unread}"


def test_the_spec_file_is_where_the_trainer_is_told_to_read_it():
    objects = plan(parse(RUN)).objects
    container = pod_of(objects)["containers"][0]
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    assert container["command"][container["command"].index("--config") + 1] == contract.SPEC_PATH
    mount = next(m for m in container["volumeMounts"] if m["name"] == "spec")
    assert (mount["mountPath"], list(configmap["data"])) == (contract.SPEC_MOUNT, [contract.SPEC_FILE])
