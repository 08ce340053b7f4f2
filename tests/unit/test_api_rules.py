"""The TrainingSpec API offline: cross-field rules, errors that name the field, samples, the CRD file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kiln.api.crd import crd
from kiln.api.load import check_cluster, load_file, parse
from kiln.api.rules import NAME_CEL, RULES
from kiln.cli.main import main
from kiln.errors import KilnError
from tests.support.specs import BASE, with_

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))

# (what is broken, the field path in the error, the rule's message fragment)
INVALID = [
    ({"model": {"dim": 64}}, "spec.model:", "set model.preset"),
    ({"model": {"preset": "tiny", "kvHeads": 3}}, "spec.model.kvHeads:", "must divide model.heads"),
    ({"model": {"preset": "tiny", "dim": 100}}, "spec.model.dim:", "multiple of 2 × model.heads"),
    ({"model": {"preset": "tiny-moe", "moe": {"experts": 4, "topK": 6}}}, "spec.model.moe.topK:",
     "at most model.moe.experts"),
    ({"parallelism.tensor": 16, "resources.gpusPerNode": 16}, "spec.parallelism.tensor:", "divide model.heads"),
    ({"parallelism.tensor": 4, "resources.processesPerNode": 2}, "spec.parallelism.tensor:", "processes per node"),
    ({"parallelism.pipeline": 32, "parallelism.tensor": 1, "resources.nodes": 4, "elastic.plan": [],
      "training.globalBatchSize": 64}, "spec.parallelism.pipeline:", "must not exceed model.layers"),
    ({"parallelism.pipeline": 3, "parallelism.tensor": 1, "elastic.plan": []}, "spec.parallelism:",
     "must divide the world size"),
    ({"parallelism.replicate": 3}, "spec.parallelism.replicate:", "divide the data-parallel size"),
    ({"training.globalBatchSize": 20}, "spec.training.globalBatchSize:", "multiple of microBatchSize"),
    ({"parallelism.pipelineMicrobatches": 3}, "spec.parallelism.pipelineMicrobatches:", "split evenly"),
    ({"training.warmupSteps": 101}, "spec.training.warmupSteps:", "must not exceed training.steps"),
    ({"resources.gpusPerNode": 0, "parallelism.tensor": 1, "parallelism.pipeline": 1, "elastic.plan": [],
      "training.globalBatchSize": 4}, "spec.resources.gpuType:", "gpusPerNode > 0"),
    ({"resources.gpuType": "nvidia-h200"}, "spec.resources.gpuType:", "case-sensitive"),
    ({"elastic.minNodes": 3}, "spec.elastic.minNodes:", "at most resources.nodes"),
    ({"elastic.maxNodes": 1, "elastic.plan": []}, "spec.elastic.maxNodes:", "at least resources.nodes"),
    ({"elastic.plan": [{"nodes": 1}, {"untilStep": 5, "nodes": 2}]}, "spec.elastic.plan:", "needs untilStep"),
    ({"elastic.plan": [{"untilStep": 50, "nodes": 1}, {"untilStep": 20, "nodes": 2}, {"nodes": 4}]},
     "spec.elastic.plan:", "strictly increase"),
    ({"elastic.plan": [{"untilStep": 5, "nodes": 8}, {"nodes": 2}]}, "spec.elastic.plan:",
     "lie in [elastic.minNodes, elastic.maxNodes]"),
    ({"checkpoint.uri": "gs://bucket/x"}, "spec.checkpoint.uri:", "s3:// or file://"),
    ({"checkpoint.intervalSteps": 0}, "spec.checkpoint.intervalSteps:", "positive integer or 'auto'"),
    ({"data": {"uri": "http://example.com/data"}}, "spec.data.uri:", "'synthetic', builtin:<name>"),
    ({"model": {"preset": "tiny", "from": "s3://models/llama/"}}, "spec.model.from:", "exclude each other"),
    ({"model": {"from": "hf://meta-llama/Llama-3.2-1B"}}, "spec.model.from:", "file:///path/ or s3://"),
    ({"data": {"tokenizer": "gpt2"}}, "spec.data.tokenizer:", "'byte', or a tokenizer.json"),
    ({"data": {"sources": [{"uri": "synthetic", "weight": 1}, {"uri": "gs://b/x/", "weight": 1}]}},
     "spec.data.sources:", "every data.sources uri"),
    ({"data": {"uri": "s3://data/web/", "sources": [{"uri": "synthetic", "weight": 1}]}}, "spec.data.sources:",
     "leave data.uri unset"),
    ({"data": {"format": "chat", "uri": "s3://data/chat/", "tokenizer": "byte"}}, "spec.data.format:",
     "renders conversations with a chat template"),
    ({"data": {"format": "chat", "sources": [{"uri": "synthetic", "weight": 1}], "tokenizer": "s3://m/llama/"}},
     "spec.data.format:", "must be a folder"),
    ({"data": {"packing": True, "uri": "builtin:pydoc"}}, "spec.data.packing:", "must be a folder"),
    ({"elastic.faultTolerance": {"mode": "replicaGroups", "groups": 4}}, "spec.elastic.faultTolerance.groups:",
     "must divide the data-parallel size"),
    ({"elastic.faultTolerance": {"mode": "replicaGroups", "groups": 2}, "elastic.minNodes": None,
      "elastic.maxNodes": None, "elastic.plan": [], "resources.nodes": 3, "training.globalBatchSize": 48},
     "spec.elastic.faultTolerance.groups:", "must divide resources.nodes"),
    ({"elastic.faultTolerance": {"mode": "replicaGroups", "groups": 2}}, "spec.elastic.faultTolerance:",
     "not supported with elastic.faultTolerance.mode replicaGroups"),
    ({"scheduling": {"topology": {"level": "topology.example.com/rack"}}}, "spec.scheduling.topology:",
     "needs scheduling.queue"),
    # mixtures of experts and expert parallelism: BASE is dense, tensor 2 x pipeline 2 (dp 4 at 2 nodes x 8)
    ({"parallelism.expert": 2, "parallelism.tensor": 1, "parallelism.pipeline": 1}, "spec.parallelism.expert:",
     "needs a mixture-of-experts model"),
    ({"model": {"preset": "tiny-moe"}, "parallelism.expert": 3, "parallelism.tensor": 1, "parallelism.pipeline": 1,
      "elastic.plan": [], "elastic.minNodes": 3, "elastic.maxNodes": 3, "resources.nodes": 3,
      "training.globalBatchSize": 48}, "spec.parallelism.expert:", "must divide model.moe.experts"),
    ({"model": {"preset": "tiny-moe"}, "parallelism.expert": 2, "parallelism.pipeline": 1,
      "parallelism.fsdp": False}, "spec.parallelism.expert:", "needs parallelism.fsdp"),
    ({"model": {"preset": "tiny-moe"}, "parallelism.expert": 8, "parallelism.tensor": 1, "parallelism.pipeline": 1,
      "parallelism.replicate": 2}, "spec.parallelism.expert:", "must divide the FSDP shard size"),
]


@pytest.mark.parametrize("changes,path,fragment", INVALID, ids=[c[1] + c[2][:20] for c in INVALID])
def test_each_rule_refuses_with_its_field_path(changes, path, fragment):
    with pytest.raises(KilnError) as err:
        parse(with_(changes), "spec.yaml", scope="all")
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"spec.yaml: {path}") and fragment in line for line in lines), lines


def test_base_spec_is_valid_everywhere():
    doc = parse(BASE)
    check_cluster(doc)  # cluster-only rules too


def test_a_mixture_of_experts_takes_tensor_pipeline_and_expert_parallelism_together():
    # TP on the attention, the experts over 2 EP ranks of FSDP's shard ranks (kiln.trainer.parallel.parallelize),
    # the layers over 2 pipeline stages (BASE's tensor 2 x pipeline 2 at 2 nodes x 8)
    check_cluster(parse(with_({"model": {"preset": "tiny-moe"}, "parallelism.expert": 2})))


def test_every_rule_is_exercised_by_a_case():
    fields = {r.field for r in RULES}
    covered = {path.removeprefix("spec.").rstrip(":") for _, path, _ in INVALID}
    assert fields <= covered


def test_s3_without_endpoint_or_secret_is_aws_with_ambient_credentials_everywhere():
    # no endpoint: AWS S3; no Secret: the pod's own AWS identity (kiln.storage.s3.ambient_credentials)
    check_cluster(parse(with_({"checkpoint": {"uri": "s3://ckpt/x/"}})))


def test_errors_say_what_would_be_valid():
    with pytest.raises(KilnError) as err:
        parse(with_({"parallelism.tensor": 3, "resources.processesPerNode": 3, "elastic.plan": [],
                     "elastic.minNodes": None, "elastic.maxNodes": None}))
    assert "valid tensor: 1, 2, 4, 8" in str(err.value)  # divisors of gcd(heads=32, kvHeads=8)


def test_unknown_field_and_bad_enum_name_the_path():
    doc = with_({"training.sheduel": "cosine", "training.precision": "fp16"})
    with pytest.raises(KilnError) as err:
        parse(doc, "f.yaml")
    text = str(err.value)
    assert "f.yaml: spec.training.sheduel: unknown field" in text
    assert "f.yaml: spec.training.precision: Input should be 'bf16' or 'fp32', got 'fp16'" in text


@pytest.mark.parametrize("topology,path,fragment", [
    ({"level": "rack", "mode": "strict"}, "spec.scheduling.topology.mode:", "'required' or 'preferred'"),
    ({"level": "my rack"}, "spec.scheduling.topology.level:", "should match pattern"),
    ({"level": "Example.com/rack"}, "spec.scheduling.topology.level:", "should match pattern"),
    ({"level": "example.com/" + "r" * 64}, "spec.scheduling.topology.level:", "should match pattern"),
    ({"level": "a" * 254 + "/rack"}, "spec.scheduling.topology.level:", "at most 253 characters"),
    ({"mode": "required"}, "spec.scheduling.topology.level:", "Field required"),
])


def test_topology_mode_and_level_key_are_checked_offline(topology, path, fragment):
    with pytest.raises(KilnError) as err:
        parse(with_({"scheduling": {"queue": "team-a", "topology": topology}}), "spec.yaml")
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"spec.yaml: {path}") and fragment in line for line in lines), lines


def test_topology_levels_are_label_keys_with_or_without_a_prefix():
    for level in ("rack", "kubernetes.io/hostname", "cloud.provider.com/topology-block", "a" * 253 + "/r"):
        doc = parse(with_({"scheduling": {"queue": "team-a", "topology": {"level": level}}}))
        assert doc.spec.scheduling.topology.level == level and doc.spec.scheduling.topology.mode == "required"


def test_metadata_name_must_fit_the_pytorchjob():
    bad = copy.deepcopy(BASE)
    bad["metadata"]["name"] = "My_Run"
    with pytest.raises(KilnError, match="metadata.name must be a DNS-1035 label"):
        parse(bad)
    assert "metadata.name" in NAME_CEL


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_samples_are_valid(sample, capsys):
    assert main(["validate", str(sample)]) == 0
    assert "valid" in capsys.readouterr().out


def test_quickstart_stays_a_cpu_run():
    (doc,) = load_file(ROOT / "manifests" / "samples" / "quickstart.yaml")
    assert doc.spec.resources.gpus_per_node == 0 and doc.spec.model.preset == "tiny"


def test_validate_cli_exit_codes_and_messages(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_({"parallelism.tensor": 3})))
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert main(["validate", str(bad), str(broken), str(tmp_path / "missing.yaml"), str(SAMPLES[0])]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: spec.parallelism.tensor:" in err
    assert f"{broken}: not valid YAML" in err
    assert "missing.yaml: cannot read" in err
    assert "Traceback" not in err


def test_crd_is_structural_and_carries_rules_and_subresources():
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]

    def walk(node, path="spec"):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "properties" in node or "additionalProperties" in node:
            assert node.get("type") == "object", path
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), path
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], path + "[]")

    walk(spec)
    walk(schema["properties"]["status"], "status")
    assert spec["properties"]["parallelism"]["properties"]["tensor"]["description"]
    assert spec["properties"]["model"]["default"] == {"preset": "tiny"}
    rules = spec["x-kubernetes-validations"]
    assert len(rules) == len(RULES) and all(r["fieldPath"].startswith(".") for r in rules)
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.resources.nodes"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Nodes", "Step", "Progress", "Age"]
    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert phases == ["Pending", "Queued", "Running", "Scaling", "Restarting", "Suspended", "Succeeded", "Failed"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_samples_resolve_into_specs_the_operator_renders(sample):
    """What the operator stores in the run's ConfigMap is the resolved spec, every default explicit: it must be a
    valid spec itself (a preset's internal fields, such as an MoE's shared gate, are not spec fields)."""
    from kiln.control.config import OperatorConfig
    from kiln.control.plan import plan, resolve

    for doc in load_file(sample):
        config = OperatorConfig(image="registry.test/trainer:1")
        resolved = resolve(doc, config)
        assert parse(resolved.model_dump(mode="json", by_alias=True, exclude_none=True)).spec == resolved.spec
        assert plan(doc, None, config).refused is None
