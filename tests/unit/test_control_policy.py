"""The admin's limits on trainer pods (kiln.control.policy), the disk budget, and how plan and render apply them."""

from __future__ import annotations

import pytest
import yaml

from kiln.api.load import parse
from kiln.cli.main import main
from kiln.control.config import OperatorConfig
from kiln.control.plan import plan, quantity_bytes
from kiln.control.policy import AdminPolicy, violations

from tests.unit.test_api_rules import BASE, with_

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
