"""A run in a queue whose ClusterQueue does not cover every request: kiln's own defaults are left out, a
request the spec asks for is refused by field (kiln.control.plan.queue_fit, kiln.control.kueue coverage)."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from kiln.control import kueue
from kiln.control.config import OperatorConfig
from kiln.control.plan import Observed, plan
from tests.support.specs import doc_of, with_, worker

CONFIG = OperatorConfig(image="registry.test/trainer:1")
# Kueue's own examples: cpu, memory and GPUs, no ephemeral-storage
KUEUE_EXAMPLE = kueue.Coverage("gpus", frozenset({"cpu", "memory", "nvidia.com/gpu"}))
QUEUED = with_({"scheduling.queue": "team-a"})


def job_of(result) -> dict:
    assert result.refused is None, result.refused
    return next(o for o in result.objects if o["kind"] == "PyTorchJob")


def container(job: dict) -> dict:
    return worker(job)["template"]["spec"]["containers"][0]


def env(job: dict) -> dict:
    return {e["name"]: e.get("value") for e in container(job)["env"]}


def test_a_default_the_queue_does_not_cover_is_left_out_and_said():
    result = plan(doc_of(QUEUED), Observed(queue_coverage=KUEUE_EXAMPLE), CONFIG)
    job = job_of(result)
    res = container(job)["resources"]
    assert "ephemeral-storage" not in res["requests"] and "ephemeral-storage" not in res["limits"]
    assert res["requests"]["nvidia.com/gpu"] == "8" and res["limits"]["memory"] == "4Gi"
    # no disk budget: the trainer checks the node's free disk only (kiln.trainer.data.check_cache_room)
    assert "KILN_DATA_CACHE_BYTES" not in env(job)
    assert job["metadata"]["annotations"] == {kueue.LEFT_OUT_ANNOTATION: "ephemeral-storage"}
    assert any("ephemeral-storage" in n and "ClusterQueue gpus" in n for n in result.notes)


def test_a_request_the_spec_asks_for_is_refused_naming_the_field_and_both_fixes():
    raw = with_({"scheduling.queue": "team-a", "resources.ephemeralStorage": "100Gi"})
    result = plan(doc_of(raw), Observed(queue_coverage=KUEUE_EXAMPLE), CONFIG)
    assert result.objects == [] and result.refused_reason == "NotCoveredByQueue"
    assert "spec.resources.ephemeralStorage" in result.refused and "ClusterQueue gpus" in result.refused
    assert "coveredResources" in result.refused and "leave spec.resources.ephemeralStorage unset" in result.refused


def test_gpus_the_queue_does_not_cover_are_refused_not_dropped():
    cpu_only = kueue.Coverage("cpus", frozenset({"cpu", "memory", "ephemeral-storage"}))
    result = plan(doc_of(QUEUED), Observed(queue_coverage=cpu_only), CONFIG)
    assert result.refused_reason == "NotCoveredByQueue" and "spec.resources.gpusPerNode" in result.refused


def test_kueues_excluded_prefixes_count_as_covered():
    excluded = kueue.Coverage("gpus", KUEUE_EXAMPLE.resources, excluded_prefixes=("ephemeral-",))
    res = container(job_of(plan(doc_of(QUEUED), Observed(queue_coverage=excluded), CONFIG)))["resources"]
    assert res["limits"]["ephemeral-storage"] == "50Gi"


def test_a_live_job_keeps_what_was_left_out_when_it_was_made():
    # the admin covered ephemeral-storage meanwhile; the admitted job's pod set must not change under it
    covered = kueue.Coverage("gpus", KUEUE_EXAMPLE.resources | {"ephemeral-storage"})
    first = job_of(plan(doc_of(QUEUED), Observed(queue_coverage=KUEUE_EXAMPLE), CONFIG))
    again = job_of(plan(doc_of(QUEUED), Observed(queue_coverage=covered, left_out=kueue.left_out_of(first)), CONFIG))
    assert container(again)["resources"] == container(first)["resources"]
    # a job made before (no annotation) keeps everything
    assert kueue.left_out_of({"metadata": {}}) == ()


def test_unknown_coverage_requests_everything():
    res = container(job_of(plan(doc_of(QUEUED), Observed(), CONFIG)))["resources"]
    assert res["limits"]["ephemeral-storage"] == "50Gi"


class _Custom:
    def __init__(self, objects: dict, status: int | None = None):
        self.objects, self.status = objects, status

    def _get(self, key):
        if self.status:
            raise ApiException(status=self.status)
        if key not in self.objects:
            raise ApiException(status=404)
        return self.objects[key]

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return self._get((plural, namespace, name))

    def get_cluster_custom_object(self, group, version, plural, name):
        return self._get((plural, name))


class _Kube:
    def __init__(self, custom):
        self.custom = custom


CQ = {"spec": {"resourceGroups": [{"coveredResources": ["cpu", "memory"]},
                                  {"coveredResources": ["nvidia.com/gpu"]}]}}


def test_coverage_is_read_through_the_local_queue():
    kube = _Kube(_Custom({("localqueues", "ml", "team-a"): {"spec": {"clusterQueue": "gpus"}},
                          ("clusterqueues", "gpus"): CQ}))
    cov = kueue.read_coverage(kube, "ml", "team-a")
    assert cov == kueue.Coverage("gpus", frozenset({"cpu", "memory", "nvidia.com/gpu"}))
    assert kueue.read_coverage(kube, "ml", "other") is None  # no LocalQueue: Kueue itself says so


@pytest.mark.parametrize("status", [403, 404])
def test_coverage_not_readable_is_unknown(status):
    assert kueue.read_coverage(_Kube(_Custom({}, status)), "ml", "team-a") is None
    with pytest.raises(ApiException):
        kueue.read_coverage(_Kube(_Custom({}, 500)), "ml", "team-a")


def test_an_admitted_job_is_not_read_again_a_held_one_is():
    held = {"metadata": {"annotations": {kueue.LEFT_OUT_ANNOTATION: "ephemeral-storage"}},
            "spec": {"runPolicy": {"suspend": True}}}
    running = {**held, "spec": {"runPolicy": {"suspend": False}}}
    kube = _Kube(_Custom({("localqueues", "ml", "team-a"): {"spec": {"clusterQueue": "gpus"}},
                          ("clusterqueues", "gpus"): CQ}))
    assert kueue.observe_queue(_Kube(_Custom({}, 500)), "ml", "team-a", [running]) == (None, ("ephemeral-storage",))
    cov, left = kueue.observe_queue(kube, "ml", "team-a", [held])
    assert cov.cluster_queue == "gpus" and left is None
    assert kueue.observe_queue(kube, "ml", None, [running]) == (None, None)
