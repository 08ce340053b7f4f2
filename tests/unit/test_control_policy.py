"""The admin's limits on trainer pods (kiln.control.policy), the disk budget, and how plan and render apply them."""

from __future__ import annotations

import pytest
import yaml

from kiln.api.load import parse
from kiln.cli.main import main
from kiln.control.config import OperatorConfig
from kiln.control.plan import plan, quantity_bytes
from kiln.control.policy import AdminPolicy, violations
from tests.support.specs import BASE, with_

DEFAULT_IMAGE = OperatorConfig().image


def refused(changes: dict, policy: AdminPolicy = AdminPolicy()) -> list[str]:
    return violations(parse(with_(changes)).spec, policy, DEFAULT_IMAGE)


CONTROL_PLANE = "node-role.kubernetes.io/control-plane"


@pytest.mark.parametrize("changes,fragment", [
    ({"scheduling.priorityClassName": "system-node-critical"}, "spec.scheduling.priorityClassName: 'system-node"),
    ({"resources.nodeSelector": {CONTROL_PLANE: ""}}, "spec.resources.nodeSelector: 'node-role"),
    ({"resources.affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "Exists"}]}}]}}},
     "spec.resources.affinity: 'node-role"),
    ({"resources.tolerations": [{"operator": "Exists"}]}, "spec.resources.tolerations[0]: operator Exists without"),
    ({"resources.tolerations": [{"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}]},
     "spec.resources.tolerations[0]: tolerating 'node-role"),
])


def test_the_defaults_keep_pods_off_the_control_plane_and_away_from_system_priorities(changes, fragment):
    problems = refused(changes)
    assert len(problems) == 1 and problems[0].startswith(fragment), problems


def test_the_defaults_allow_an_ordinary_gpu_run_and_keeping_away_from_nodes():
    assert refused({}) == []
    away = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "DoesNotExist"}]}]}}}
    assert refused({"resources.affinity": away, "scheduling.priorityClassName": "team-high",
                    "resources.tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}]}) == []


def test_image_and_priority_allow_lists():
    policy = AdminPolicy(allowed_image_prefixes=("registry.corp/ml/",), allowed_priority_classes=("batch-low",))
    assert refused({"image": "registry.corp/ml/trainer:1"}, policy) == []
    assert refused({"image": DEFAULT_IMAGE}, policy) == []  # the operator's own image always may run
    (image,) = refused({"image": "docker.io/evil/miner:latest"}, policy)
    assert image.startswith("spec.image: 'docker.io/evil/miner:latest' is not allowed") and "registry.corp/ml/" in image
    (priority,) = refused({"scheduling.priorityClassName": "batch-high"}, policy)
    assert "allowed: batch-low" in priority


def test_policy_from_the_operators_environment():
    config = OperatorConfig.from_env({"KILN_POLICY_IMAGE_PREFIXES": "a/, b/", "KILN_POLICY_PRIORITY_CLASSES": "",
                                      "KILN_POLICY_FORBIDDEN_NODE_KEYS": "gpu.corp/reserved",
                                      "KILN_POLICY_ALLOW_TOLERATE_ALL": "true"})
    assert config.policy == AdminPolicy(allowed_image_prefixes=("a/", "b/"), allowed_priority_classes=(),
                                        forbidden_node_keys=("gpu.corp/reserved",), allow_tolerate_all=True)
    assert OperatorConfig.from_env({}).policy == AdminPolicy()


def test_plan_refuses_with_the_policy_reason_and_applies_nothing():
    desired = plan(parse(with_({"scheduling.priorityClassName": "system-cluster-critical"})))
    assert desired.objects == [] and desired.refused_reason == "ForbiddenByPolicy"
    assert "system-cluster-critical" in desired.refused


def test_render_says_what_the_policy_forbids(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(with_({"resources.tolerations": [{"operator": "Exists"}]})))
    assert main(["render", str(path)]) == 1
    assert "spec.resources.tolerations[0]: operator Exists without a key" in capsys.readouterr().err


def test_every_pod_has_a_disk_limit_and_the_trainer_knows_it():
    def container(doc):
        job = next(o for o in plan(parse(doc)).objects if o["kind"] == "PyTorchJob")
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]

    default = container(BASE)
    assert default["resources"]["limits"]["ephemeral-storage"] == "50Gi"
    assert default["resources"]["requests"]["ephemeral-storage"] == "50Gi"
    env = {e["name"]: e.get("value") for e in default["env"]}
    assert env["KILN_DATA_CACHE_BYTES"] == str(50 * 2**30)
    big = container(with_({"resources.ephemeralStorage": "2Ti"}))
    assert big["resources"]["limits"]["ephemeral-storage"] == "2Ti"
    assert {e["name"]: e.get("value") for e in big["env"]}["KILN_DATA_CACHE_BYTES"] == str(2 * 2**40)


@pytest.mark.parametrize("quantity,expected", [("50Gi", 50 * 2**30), ("100G", 10**11), ("1000", 1000),
                                               ("1.5Ki", 1536), ("2Ti", 2 * 2**40)])


def test_quantity_bytes(quantity, expected):
    assert quantity_bytes(quantity) == expected


def test_a_quantity_kubernetes_would_refuse_is_refused_at_validate():
    with pytest.raises(Exception, match="resources.memory"):
        parse(with_({"resources.memory": "4 GB"}))


@pytest.mark.parametrize("affinity", [{"nodeAffinity": "not an object"}, {"nodeAffinity": {
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": ["x", {"matchExpressions": [1]}]},
    "preferredDuringSchedulingIgnoredDuringExecution": [None, {"preference": []}]}}])


def test_a_malformed_affinity_is_left_to_the_apiserver_to_refuse(affinity):
    assert refused({"resources.affinity": affinity}) == []  # no crash: the apply's refusal names the problem


DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize("image,rule,allowed", [
    ("registry.example.com/ml/trainer:1", "registry.example.com", True),
    ("registry.example.com.attacker.io/x", "registry.example.com", False),  # a longer host is another registry
    ("registry.example.com:5000/x", "registry.example.com", False),  # another port: another registry
    ("ghcr.io/org/kiln-trainer:1", "ghcr.io/org/kiln-trainer", True),
    ("ghcr.io/org/kiln-trainer/cuda12:1", "ghcr.io/org/kiln-trainer", True),
    ("ghcr.io/org/kiln-trainer-evil:1", "ghcr.io/org/kiln-trainer", False),  # a longer repository name
    ("ghcr.io/org/kiln-trainer-evil:1", "ghcr.io/org/kiln-trainer/", False),
    (f"ghcr.io/org/kiln-trainer@{DIGEST}", "ghcr.io/org/kiln-trainer", True),
    (f"ghcr.io/org/kiln-trainer@{DIGEST}", f"ghcr.io/org/kiln-trainer@{DIGEST}", True),  # a pinned digest
    (f"ghcr.io/org/kiln-trainer:1@{DIGEST}", f"ghcr.io/org/kiln-trainer@{DIGEST}", True),
    ("ghcr.io/org/kiln-trainer@sha256:" + "b" * 64, f"ghcr.io/org/kiln-trainer@{DIGEST}", False),
    ("ghcr.io/org/kiln-trainer:1", f"ghcr.io/org/kiln-trainer@{DIGEST}", False),  # a tag can move; the digest not
    ("ghcr.io/org/kiln-trainer:1", "ghcr.io/org/kiln-trainer:1", True),
    ("ghcr.io/org/kiln-trainer:2", "ghcr.io/org/kiln-trainer:1", False),
    ("localhost:5000/ml/x", "localhost:5000", True),
    ("ubuntu:22.04", "docker.io/library", True),  # Docker Hub's short names spelled out as runtimes do
    ("evil/ubuntu:22.04", "docker.io/library", False),
    ("docker.io/library/ubuntu", "ubuntu", True),
])


def test_image_rules_match_at_registry_and_repository_boundaries(image, rule, allowed):
    problems = refused({"image": image}, AdminPolicy(allowed_image_prefixes=(rule,)))
    assert (problems == []) is allowed, problems
    if not allowed:
        assert problems[0].startswith(f"spec.image: {image!r} is not allowed here")


HOSTNAME = "kubernetes.io/hostname"


def node_affinity(term: dict, required: bool = True) -> dict:
    if required:
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": term}]}}


def pod_term(**extra) -> dict:
    return {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOSTNAME, **extra}


@pytest.mark.parametrize("changes,fragment", [
    # picking nodes by name reaches the control plane whatever its labels
    ({"resources.nodeSelector": {HOSTNAME: "cp-1"}}, "spec.resources.nodeSelector: 'kubernetes.io/hostname' picks"),
    ({"resources.affinity": node_affinity({"matchExpressions": [
        {"key": HOSTNAME, "operator": "In", "values": ["cp-1"]}]})}, "spec.resources.affinity: picking nodes by name"),
    ({"resources.affinity": node_affinity({"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["cp-1"]}]}, required=False)},
     "spec.resources.affinity: picking nodes by name"),
    # pods of other namespaces: attracted to, or used to repel, theirs
    ({"resources.affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        pod_term(namespaces=["kube-system"])]}}},
     "spec.resources.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]: namespaces"),
    ({"resources.affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "podAffinityTerm": pod_term(namespaceSelector={})}]}}},
     "spec.resources.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm"),
    # cordoned nodes
    ({"resources.tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
                                 "effect": "NoSchedule"}]},
     "spec.resources.tolerations[0]: tolerating 'node.kubernetes.io/unschedulable'"),
])


def test_the_node_and_pod_fences_cover_names_other_namespaces_and_cordons(changes, fragment):
    problems = refused(changes)
    assert len(problems) == 1 and problems[0].startswith(fragment), problems


def test_what_stays_allowed_around_the_new_fences():
    # keeping away from named nodes (as kiln's own avoidance does), pod affinity within the run's namespace
    away = node_affinity({"matchExpressions": [{"key": HOSTNAME, "operator": "NotIn", "values": ["bad-1"]}],
                          "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["bad-2"]}]})
    assert refused({"resources.affinity": {**away, "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [pod_term()]}}}) == []
    # the admin may allow names
    named = {"resources.nodeSelector": {HOSTNAME: "gpu-7"}}
    assert refused(named, AdminPolicy(allow_node_names=True)) == []


def test_queue_priorities_under_an_allow_list():
    policy = AdminPolicy(allowed_queue_priorities=("low", "normal"))
    assert refused({"scheduling.priority": "normal"}, policy) == []
    (problem,) = refused({"scheduling.priority": "urgent"}, policy)
    assert problem == "spec.scheduling.priority: 'urgent' is not allowed here; allowed: low, normal"
    assert refused({"scheduling.priority": "urgent"}) == []  # no list: any, as before


@pytest.mark.parametrize("policy,changes,fragment", [
    # BASE: nodes 2, elastic.maxNodes 4, 8 GPUs per node: the run may grow to 4 nodes, 32 GPUs
    (AdminPolicy(max_nodes=3), {}, "spec.elastic.maxNodes: 4 nodes is more than this cluster allows per run (3)"),
    (AdminPolicy(max_nodes=1), {"elastic": None}, "spec.resources.nodes: 2 nodes is more than"),
    (AdminPolicy(max_gpus=31), {}, "spec.resources.gpusPerNode: 4 node(s) x 8 GPUs = 32 GPUs is more than"),
    (AdminPolicy(max_groups=2), {"elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 4}}},
     "spec.elastic.faultTolerance.groups: 4 replica groups is more than this cluster allows per run (2)"),
])


def test_size_caps_per_run_are_refused_by_name(policy, changes, fragment):
    problems = refused(changes, policy)
    assert len(problems) == 1 and problems[0].startswith(fragment), problems


def test_a_run_at_the_caps_is_allowed():
    assert refused({}, AdminPolicy(max_nodes=4, max_gpus=32, max_groups=1)) == []


def test_the_new_rules_from_the_operators_environment():
    policy = OperatorConfig.from_env({"KILN_POLICY_QUEUE_PRIORITIES": "low,normal", "KILN_POLICY_ALLOW_NODE_NAMES": "1",
                                      "KILN_POLICY_MAX_NODES": "64", "KILN_POLICY_MAX_GPUS": "512",
                                      "KILN_POLICY_MAX_GROUPS": "", "KILN_POLICY_ALLOW_TOLERATE_ALL": "false"}).policy
    assert policy == AdminPolicy(allowed_queue_priorities=("low", "normal"), allow_node_names=True, max_nodes=64,
                                 max_gpus=512)


def test_a_cap_that_is_not_a_number_is_named():
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="KILN_POLICY_MAX_GPUS='eight': a cap is a whole number"):
        AdminPolicy.from_env({"KILN_POLICY_MAX_GPUS": "eight"})
