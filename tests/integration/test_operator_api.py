"""The TrainingSpec API on the real apiserver: the generated CRD, its CEL rules and the rendered objects.

The property tests draw random specs, judge them with kiln's Python rules, and require the apiserver
to agree exactly: valid → accepted (and the rendered PyTorchJob passes the training-operator's
webhook), invalid → refused with the same field paths. That is the proof that the rules are written
once and enforced twice.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from kiln.api.load import dump_for_apply, parse
from kiln.api.rules import NAME_MAX, NAME_PATTERN, RULES
from kiln.api.spec import GROUP, PLURAL, VERSION, TrainingSpec
from kiln.control.kube import Kube
from kiln.control.plan import plan
from kiln.errors import KilnError
from tests.support.operator import create_dry_run, kube, refused_fields

pytestmark = pytest.mark.rig

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


def apply_dry_run(kube: Kube, obj: dict) -> None:
    kind_api = {"PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs")}
    if obj["kind"] in kind_api:
        group, version, plural = kind_api[obj["kind"]]
        kube.custom.create_namespaced_custom_object(group, version, obj["metadata"]["namespace"], plural, obj,
                                                    dry_run="All")
    elif obj["kind"] == "ConfigMap":
        kube.core.create_namespaced_config_map(obj["metadata"]["namespace"], obj, dry_run="All")
    elif obj["kind"] == "ServiceAccount":
        kube.core.create_namespaced_service_account(obj["metadata"]["namespace"], obj, dry_run="All")
    elif obj["kind"] == "Role":
        k8s.RbacAuthorizationV1Api(kube.api).create_namespaced_role(obj["metadata"]["namespace"], obj, dry_run="All")
    elif obj["kind"] == "NetworkPolicy":
        k8s.NetworkingV1Api(kube.api).create_namespaced_network_policy(obj["metadata"]["namespace"], obj, dry_run="All")
    elif obj["kind"] == "RoleBinding":
        k8s.RbacAuthorizationV1Api(kube.api).create_namespaced_role_binding(obj["metadata"]["namespace"], obj,
                                                                            dry_run="All")
    else:
        raise AssertionError(obj["kind"])


def without_owner(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("ownerReferences", None)  # the owner does not exist in a dry run
    return obj


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_samples_are_accepted_and_render_accepted_objects(kube, namespace, sample):
    for raw in yaml.safe_load_all(sample.read_text()):
        doc = parse(raw)
        doc.metadata.namespace = namespace
        create_dry_run(kube, namespace, dump_for_apply(doc))
        for obj in plan(doc).objects:
            apply_dry_run(kube, without_owner(obj))


def test_crd_defaults_match_the_models(kube, namespace):
    """What the apiserver stores for an empty spec is what pydantic fills in."""
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "defaults"}}
    stored = kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")
    assert TrainingSpec.model_validate(stored).spec == parse(body).spec
    assert stored["spec"]["model"] == {"preset": "tiny"} and stored["spec"]["training"]["steps"] == 1000


def test_invalid_spec_is_refused_with_the_cel_message(kube, namespace, rig):
    bad = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "bad", "namespace": namespace},
           "spec": {"model": {"preset": "tiny"}, "parallelism": {"tensor": 3}, "resources": {"processesPerNode": 3}}}
    proc = rig.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    rule = next(r for r in RULES if r.name == "tensor-divides-heads")
    assert "spec.parallelism.tensor" in proc.stderr and rule.message in proc.stderr
    with pytest.raises(KilnError, match="spec.parallelism.tensor: " + rule.message):
        parse(bad)


# ---- property tests: the apiserver and kiln's Python rules agree on random specs ----

@st.composite
def specs(draw) -> dict:
    """Random specs inside every per-field bound, so only cross-field rules decide."""
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    nodes = draw(st.integers(1, 4))
    spec: dict = {
        "model": draw(st.one_of(
            st.fixed_dictionaries({"preset": st.sampled_from(["tiny", "small", "llama-1b", "llama-8b"])}),
            st.fixed_dictionaries({"preset": st.just("tiny")}, optional={"heads": st.sampled_from([2, 4, 6, 8]),
                                                                          "kvHeads": st.sampled_from([1, 2, 3, 4])}),
            st.fixed_dictionaries({"dim": st.sampled_from([64, 96, 128]), "layers": st.integers(1, 6),
                                   "heads": st.sampled_from([2, 4, 8]), "vocabSize": st.just(256),
                                   "seqLen": st.just(64)}, optional={"kvHeads": st.sampled_from([1, 2, 4])}),
            st.fixed_dictionaries({}, optional={"dim": st.just(64), "layers": st.just(2)}),
            st.fixed_dictionaries({"preset": st.just("tiny-moe")}, optional={  # mixtures of experts
                "moe": st.fixed_dictionaries({}, optional={"experts": st.sampled_from([2, 3, 4, 8])})}),
            st.fixed_dictionaries({"from": st.just("s3://m/mixtral/")}, optional={
                "moe": st.fixed_dictionaries({"experts": st.sampled_from([4, 6])})}),
        )),
        "training": {"steps": draw(st.integers(1, 100)), "globalBatchSize": draw(st.sampled_from([1, 4, 8, 12, 16, 64])),
                     "microBatchSize": draw(st.sampled_from([1, 2, 4])), "warmupSteps": draw(st.integers(0, 120))},
        "parallelism": {"tensor": draw(st.sampled_from([1, 2, 4, 8])), "pipeline": draw(st.sampled_from([1, 2, 3, 8])),
                        "replicate": draw(st.sampled_from([1, 2]))},
        "resources": {"nodes": nodes, "gpusPerNode": gpus},
        "data": {"uri": draw(st.sampled_from(["synthetic", "builtin:pydoc", "s3://d/t/"] * 3 + ["gs://d/t/"]))},
        **({"data": {"sources": draw(st.lists(st.fixed_dictionaries({
            "uri": st.sampled_from(["synthetic", "file:///d/a/", "s3://d/b/", "gs://d/c/"]),
            "weight": st.sampled_from([0.5, 1, 3])}), min_size=1, max_size=3)),
            **({"uri": "s3://d/t/"} if draw(st.booleans()) else {})}} if draw(st.booleans()) else {}),
        "checkpoint": {"intervalSteps": draw(st.sampled_from([1, 50, "auto"] * 3 + [0]))},
    }
    if draw(st.booleans()):
        spec["resources"]["processesPerNode"] = draw(st.sampled_from([1, 2, 4, 8]))
    if draw(st.booleans()):
        spec["parallelism"]["pipelineMicrobatches"] = draw(st.sampled_from([1, 2, 3, 4]))
    if draw(st.booleans()):  # expert parallelism (a dense model refuses it)
        spec["parallelism"]["expert"] = draw(st.sampled_from([1, 2, 3, 4]))
    if draw(st.booleans()):
        spec["parallelism"]["fsdp"] = False  # replicate then means nothing: no rule on it
    if draw(st.booleans()):
        spec["resources"]["gpuType"] = "NVIDIA-H200"
    if draw(st.booleans()):  # chat data: folders only, and a tokenizer to take the chat template from
        spec["data"]["format"] = draw(st.sampled_from(["chat", "text"]))
        tokenizer = draw(st.sampled_from([None, "byte", "s3://m/llama/"]))
        if tokenizer:
            spec["data"]["tokenizer"] = tokenizer
    if draw(st.booleans()):  # packed rows: folders only
        spec["data"]["packing"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["elastic"] = {"minNodes": draw(st.integers(1, 4)), "maxNodes": draw(st.integers(1, 6))}
        if draw(st.booleans()):
            spec["elastic"]["plan"] = draw(st.lists(st.fixed_dictionaries(
                {"nodes": st.integers(1, 6)}, optional={"untilStep": st.sampled_from([10, 20, 30])}),
                min_size=1, max_size=3))
    if draw(st.booleans()):  # replica groups: they divide the data-parallel size and the nodes, at a fixed size
        spec.setdefault("elastic", {})["faultTolerance"] = draw(st.fixed_dictionaries({}, optional={
            "mode": st.sampled_from(["replicaGroups"] * 3 + ["off"]), "groups": st.integers(1, 4)}))
    uri = draw(st.sampled_from([None, "file:///ckpt/", "s3://b/run/", "ftp://x/"]))
    if uri:
        spec["checkpoint"]["uri"] = uri
        if draw(st.booleans()):
            spec["checkpoint"].update(endpoint="http://s3:9000", credentialsSecret="s3")
    name = draw(st.sampled_from(["run", "run-2"] * 4 + ["Run_2", "r" * 46]))
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name}, "spec": spec}


@st.composite
def valid_specs(draw) -> dict:
    """Random specs built to satisfy every rule (GPU layouts, elastic ranges, phase plans, queues)."""
    from kiln.api.presets import PRESETS

    preset = draw(st.sampled_from(sorted(PRESETS)))
    dims = PRESETS[preset]
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    ppn = gpus or draw(st.sampled_from([1, 2, 4]))
    tensor = draw(st.sampled_from([t for t in (1, 2, 4, 8) if ppn % t == 0 and dims["kv_heads"] % t == 0]))
    pipeline = draw(st.sampled_from([p for p in (1, 2, 4) if p <= dims["layers"]]))
    nodes = draw(st.integers(1, 4))
    lo, hi = draw(st.integers(1, nodes)), draw(st.integers(nodes, 6))
    plan_nodes = draw(st.lists(st.integers(lo, hi), max_size=3))
    counts = [nodes, *plan_nodes]
    if any((n * ppn) % (tensor * pipeline) for n in counts):
        pipeline, tensor = 1, 1
    mbs = draw(st.sampled_from([1, 2, 4]))
    lcm = 1
    for n in counts:
        lcm = math.lcm(lcm, mbs * n * ppn // (tensor * pipeline))
    steps = draw(st.integers(10, 10_000))
    spec: dict = {
        "model": {"preset": preset},
        # x pipeline: every pipeline stage needs a microbatch of each data-parallel rank's sequences
        "training": {"steps": steps, "globalBatchSize": lcm * pipeline * draw(st.integers(1, 3)), "microBatchSize": mbs,
                     "warmupSteps": draw(st.integers(0, steps))},
        "parallelism": {"tensor": tensor, "pipeline": pipeline},
        "resources": {"nodes": nodes, "gpusPerNode": gpus, "processesPerNode": ppn},
        "elastic": {"minNodes": lo, "maxNodes": hi, "maxRestarts": draw(st.integers(0, 20)),
                    "plan": [{"untilStep": 10 * (i + 1), "nodes": n} for i, n in enumerate(plan_nodes[:-1])]
                    + [{"nodes": n} for n in plan_nodes[-1:]]},
        "checkpoint": draw(st.sampled_from([
            {"uri": "s3://ckpt/run/", "endpoint": "http://s3:9000", "credentialsSecret": "s3"},
            {"uri": "file:///ckpt/"}, {}])),
        "scheduling": draw(st.fixed_dictionaries({"gang": st.booleans()},
                                                 optional={"queue": st.just("team-a")})),
        "suspend": draw(st.booleans()),
    }
    if gpus:
        spec["resources"]["gpuType"] = "NVIDIA-H200"
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "valid"}, "spec": spec}


def python_verdict(body: dict) -> set[str]:
    """The field paths kiln's rules refuse (empty: valid), read rule by rule."""
    from kiln.api.spec import TrainingSpecSpec

    raw, fields = body["spec"], {}
    for name, f in TrainingSpecSpec.model_fields.items():
        value = raw.get(f.alias or name)
        if value is not None:
            fields[name] = f.annotation.model_validate(value) if isinstance(value, dict) else value
    spec = TrainingSpecSpec.model_construct(**fields)  # every sub-object validated, the rules not yet run
    paths = {rule.path for rule in RULES if rule.check(spec) is not None}
    name = body["metadata"]["name"]
    if len(name) > NAME_MAX or not re.match(NAME_PATTERN, name):
        paths.add("metadata.name")
    return paths


def kiln_validate_refuses(body: dict) -> str | None:
    """What `kiln validate` says about the document (None: valid)."""
    try:
        parse(body, scope="all")
    except KilnError as err:
        return str(err)
    return None


def apiserver_verdict(kube: Kube, namespace: str, body: dict) -> set[str]:
    try:
        create_dry_run(kube, namespace, body)
        return set()
    except ApiException as err:
        assert err.status == 422, err.body
        return refused_fields(err)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])


@given(body=specs())
def test_apiserver_and_kiln_agree_on_random_specs(kube, namespace, body):
    expected = python_verdict(body)
    message = kiln_validate_refuses(body)
    assert (message is None) == (not expected), message
    for path in expected:
        assert path in (message or ""), (path, message)
    got = apiserver_verdict(kube, namespace, body)
    # the root-level name rule has no field path; the apiserver may add its own metadata.name check
    got = {"metadata.name" if f in ("", "<nil>") else f for f in got}
    assert got == expected, f"apiserver refused {sorted(got)}, kiln refused {sorted(expected)}"
    if not expected:
        doc = parse(body)
        doc.metadata.namespace = namespace
        for obj in plan(doc).objects:  # the rendered job passes the training-operator's webhook
            apply_dry_run(kube, without_owner(obj))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])


@given(body=valid_specs())
def test_random_valid_specs_render_jobs_the_apiserver_accepts(kube, namespace, body):
    assert python_verdict(body) == set()
    assert apiserver_verdict(kube, namespace, body) == set()
    doc = parse(body)
    doc.metadata.namespace = namespace
    for obj in plan(doc).objects:
        apply_dry_run(kube, without_owner(obj))


def test_apply_sends_each_content_once_and_again_after_forget(kube, namespace):
    """kube.apply: one server-side apply per object; the same body again sends nothing (so a drift made by
    someone else stays until the resync period ends); after forget_applied (a run's job found missing, an operator restart) it is sent
    again and the operator's fields win back."""
    doc = parse({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
                 "metadata": {"name": "once", "namespace": namespace},
                 "spec": {"suspend": True, "resources": {"nodes": 1, "gpusPerNode": 1}}})
    objects = [without_owner(o) for o in plan(doc).objects]
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "ConfigMap", "PyTorchJob"]
    cm_obj, job_obj = (next(o for o in objects if o["kind"] == kind) for kind in ("ConfigMap", "PyTorchJob"))
    for obj in objects:
        stored = kube.apply(obj)
        assert (stored["kind"], stored["metadata"]["name"]) == (obj["kind"], obj["metadata"]["name"])
        assert {(m["manager"], m["operation"]) for m in stored["metadata"]["managedFields"]} == {
            ("kiln-operator", "Apply")}
    cm = cm_obj["metadata"]["name"]
    spec_yaml = cm_obj["data"]["spec.yaml"]
    kube.core.patch_namespaced_config_map(cm, namespace, {"data": {"spec.yaml": "edited"}})

    assert all(kube.apply(o) is None for o in objects)  # nothing sent: the edit stays
    assert kube.core.read_namespaced_config_map(cm, namespace).data["spec.yaml"] == "edited"

    bigger = copy.deepcopy(job_obj)
    bigger["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2
    assert kube.apply(bigger)["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2  # changed: sent

    kube.forget_applied(namespace, "once")
    assert kube.apply(cm_obj) is not None
    assert kube.core.read_namespaced_config_map(cm, namespace).data["spec.yaml"] == spec_yaml

    # Level-triggered after all: once resync_seconds have passed, an unchanged body is sent again, so an edit
    # (or a deletion) by someone else is repaired without an operator restart.
    kube.core.patch_namespaced_config_map(cm, namespace, {"data": {"spec.yaml": "edited again"}})
    assert kube.apply(cm_obj) is None
    resync, kube.resync_seconds = kube.resync_seconds, 0.0
    try:
        assert kube.apply(cm_obj) is not None
    finally:
        kube.resync_seconds = resync
    assert kube.core.read_namespaced_config_map(cm, namespace).data["spec.yaml"] == spec_yaml


def test_apply_names_a_kind_it_does_not_write():
    with pytest.raises(ValueError, match="kiln does not write apps/v1 StatefulSet"):
        Kube(k8s.ApiClient()).apply(
            {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x", "namespace": "y"}})
