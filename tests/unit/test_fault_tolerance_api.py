"""elastic.faultTolerance: the API field, its layout rule and the per-group spec (kiln.api.layout)."""

from __future__ import annotations

import copy

import pytest

from kiln.api.crd import crd
from kiln.api.layout import plan, replica_group_spec, replica_groups
from kiln.api.load import check_cluster, parse
from kiln.errors import KilnError

DOC = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "ft"},
    "spec": {
        "model": {"preset": "llama-1b"},
        "training": {"steps": 100, "globalBatchSize": 64, "microBatchSize": 2},
        "parallelism": {"tensor": 2},
        "resources": {"nodes": 8, "gpusPerNode": 2, "gpuType": "NVIDIA-H200"},  # dp = 16 / 2 = 8, one node a rank pair
        "checkpoint": {"uri": "s3://ckpt/ft/", "endpoint": "http://s3:9000"},
    },
}


def doc(ft: dict | None) -> dict:
    d = copy.deepcopy(DOC)
    if ft is not None:
        d["spec"]["elastic"] = {"faultTolerance": ft}
    return d


def test_unset_is_off_and_leaves_the_resolved_spec_as_before():
    spec = parse(doc(None)).spec
    assert spec.elastic.fault_tolerance is None and replica_groups(spec) == 1
    assert "faultTolerance" not in spec.model_dump(by_alias=True, exclude_none=True)["elastic"]
    assert replica_group_spec(spec) is spec


def test_camel_case_fields_and_defaults():
    spec = parse(doc({"mode": "replicaGroups"})).spec
    assert spec.elastic.fault_tolerance.groups == 2 and replica_groups(spec) == 2
    assert parse(doc({"groups": 4})).spec.elastic.fault_tolerance.mode == "off"
    assert replica_groups(parse(doc({"groups": 4})).spec) == 1
    with pytest.raises(KilnError, match="spec.elastic.faultTolerance.mode"):
        parse(doc({"mode": "replica-groups"}))
    with pytest.raises(KilnError, match="spec.elastic.faultTolerance.groups"):
        parse(doc({"mode": "replicaGroups", "groups": 0}))


@pytest.mark.parametrize("groups,ok", [(1, True), (2, True), (4, True), (8, True), (3, False), (16, False)])
def test_groups_must_divide_the_data_parallel_size(groups, ok):
    d = doc({"mode": "replicaGroups", "groups": groups})
    if ok:
        check_cluster(parse(d, scope="all"))
    else:
        with pytest.raises(KilnError) as err:
            parse(d, "spec.yaml", scope="all")
        assert "spec.elastic.faultTolerance.groups: " in str(err.value)
        assert f"got groups={groups}, data-parallel size=8" in str(err.value)
    # mode off: groups is not checked
    check_cluster(parse(doc({"mode": "off", "groups": groups}), scope="all"))


def test_a_group_runs_its_share_of_the_global_batch_with_the_same_accumulation():
    spec = parse(doc({"mode": "replicaGroups", "groups": 4})).spec
    whole = plan(spec, 8)  # 16 processes, dp 8: 64 / (2 × 8) = 4 microbatches per rank
    group = replica_group_spec(spec)
    assert group.training.global_batch_size == 16 and group.elastic.fault_tolerance is None
    assert spec.training.global_batch_size == 64  # the original is untouched
    part = plan(group, 2)  # one group: 8 / 4 nodes, 4 processes, tensor 2 → dp 2
    assert (part.dp, part.tp, part.grad_accum, part.micro_batch) == (2, 2, whole.grad_accum, whole.micro_batch)


def test_crd_carries_the_field_and_the_rule():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    ft = schema["properties"]["elastic"]["properties"]["faultTolerance"]
    assert ft["properties"]["mode"]["enum"] == ["off", "replicaGroups"]
    assert ft["properties"]["groups"]["minimum"] == 1
    rules = [r for r in schema["x-kubernetes-validations"] if r.get("fieldPath", "").startswith(".elastic.faultTolerance")]
    # groups divide the data-parallel size and the nodes; no node-count elasticity with groups
    assert sorted(r["fieldPath"] for r in rules) == [".elastic.faultTolerance", ".elastic.faultTolerance.groups",
                                                     ".elastic.faultTolerance.groups"]


def test_the_operator_renders_replica_groups_and_mode_off_as_before():
    from kiln.control.plan import plan

    groups = plan(parse(doc({"mode": "replicaGroups", "groups": 2})))
    assert groups.refused is None
    assert [o["metadata"]["name"] for o in groups.objects if o["kind"] == "PyTorchJob"] == ["ft-g0", "ft-g1"]
    # mode off (or unset) renders as before: one job, no lighthouse
    off, unset = plan(parse(doc({"mode": "off", "groups": 2}))), plan(parse(doc(None)))
    assert off.refused is None and [o["kind"] for o in off.objects] == [o["kind"] for o in unset.objects]
    assert [o["metadata"]["name"] for o in off.objects if o["kind"] == "PyTorchJob"] == ["ft"]
    assert not any(o["kind"] == "Deployment" for o in off.objects)


def test_kiln_run_keeps_replica_groups_and_checks_each_group_s_world(tmp_path):
    from kiln.cli.local_run import check_layout, local_spec

    d = doc({"mode": "replicaGroups", "groups": 2})
    d["spec"]["model"] = {"preset": "tiny"}
    d["spec"]["parallelism"] = {"tensor": 1}
    run_doc, _ = local_spec(parse(d), nproc=4, steps=None, output=tmp_path)
    assert replica_groups(run_doc.spec) == 2 and run_doc.spec.resources.processes_per_node == 4
    check_layout(run_doc, 4)  # 2 groups of 2 processes
    with pytest.raises(KilnError, match="--nproc 3: elastic.faultTolerance.groups = 2 must divide it"):
        check_layout(run_doc, 3)
    off, _ = local_spec(parse(doc(None)), nproc=4, steps=None, output=tmp_path)
    assert off.spec.elastic.fault_tolerance is None
