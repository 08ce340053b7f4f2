"""The operator never takes over an object its run does not own, and says why an apply failed (issue 13,
items 3 and 8): the pure decisions; tests/integration/test_operator_ownership.py runs them on the rig."""

from __future__ import annotations

import json

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
