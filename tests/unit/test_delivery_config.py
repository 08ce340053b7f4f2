"""The operator Deployment's settings reach the operator: every variable it sets is one kiln reads."""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln.control.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = REPO / "manifests" / "operator" / "deployment.yaml"  # = the chart's default render (rig test)

# Deployment variable -> (OperatorConfig field, a non-default value to set it to)
SETTINGS = {
    "KILN_TRAINER_IMAGE": ("image", "registry.example.com/kiln-trainer:9.9"),
    "KILN_HEALTH_PORT": ("health_port", 18080),
    "KILN_METRICS_PORT": ("metrics_port", 19090),
    "KILN_DEFAULT_CPU": ("default_cpu", "8"),
    "KILN_DEFAULT_MEMORY": ("default_memory", "64Gi"),
    "KILN_DEFAULT_EPHEMERAL_STORAGE": ("default_ephemeral_storage", "2Ti"),
    "KILN_TRAINER_METRICS_PORT": ("trainer_metrics_port", 19400),
    "KILN_LEADER_LEASE": ("leader_lease", "team-a/kiln-operator-a"),
    "KILN_MONITORING_NAMESPACE": ("monitoring_namespace", "prometheus"),
}


# The admin policy's variables -> (AdminPolicy field, a value to set, what the operator makes of it)
POLICY_SETTINGS = {
    "KILN_POLICY_IMAGE_PREFIXES": ("allowed_image_prefixes", "registry.corp/,ghcr.io/kiln-dev/",
                                   ("registry.corp/", "ghcr.io/kiln-dev/")),
    "KILN_POLICY_PRIORITY_CLASSES": ("allowed_priority_classes", "batch-low", ("batch-low",)),
    "KILN_POLICY_FORBIDDEN_NODE_KEYS": ("forbidden_node_keys", "corp/reserved", ("corp/reserved",)),
    "KILN_POLICY_ALLOW_TOLERATE_ALL": ("allow_tolerate_all", "true", True),
    "KILN_POLICY_QUEUE_PRIORITIES": ("allowed_queue_priorities", "low,normal", ("low", "normal")),
    "KILN_POLICY_ALLOW_NODE_NAMES": ("allow_node_names", "true", True),
    "KILN_POLICY_MAX_NODES": ("max_nodes", "64", 64),
    "KILN_POLICY_MAX_GPUS": ("max_gpus", "512", 512),
    "KILN_POLICY_MAX_GROUPS": ("max_groups", "16", 16),
    "KILN_POLICY_HOST_PATH_PREFIXES": ("allowed_host_path_prefixes", "/mnt/data", ("/mnt/data",)),
    "KILN_POLICY_CAPABILITIES": ("allowed_capabilities", "IPC_LOCK", ("IPC_LOCK",)),
    "KILN_POLICY_EXTRA_RESOURCES": ("allowed_extra_resources", "rdma/ib", ("rdma/ib",)),
    "KILN_POLICY_SERVICE_ACCOUNTS": ("allowed_service_accounts", "trainer", ("trainer",)),
    "KILN_POLICY_ALLOW_HOST_NETWORK": ("allow_host_network", "true", True),
    "KILN_POLICY_ALLOW_HOST_IPC": ("allow_host_ipc", "true", True),
}


def deployment_env() -> dict[str, str]:
    container = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]
    # POD_ID (kopf's and the Lease's identity) and POD_NAMESPACE (where the Lease is) come from the downward
    # API: the pod's own, not settings
    return {e["name"]: e.get("value") for e in container["env"] if e["name"] not in ("POD_ID", "POD_NAMESPACE")}


# The prices for status.cost (kiln.control.config.Pricing): one structured setting from two variables
PRICING_SETTINGS = ("KILN_GPU_PRICES", "KILN_CURRENCY")
# Kueue's excludeResourcePrefixes, mirrored (kiln.control.config): a comma-separated list
QUEUE_SETTING = "KILN_KUEUE_EXCLUDED_RESOURCE_PREFIXES"


def test_every_deployment_variable_is_an_operator_setting():
    env = deployment_env()
    assert set(env) == set(SETTINGS) | set(POLICY_SETTINGS) | set(PRICING_SETTINGS) | {QUEUE_SETTING}, \
        "a variable the operator does not read, or a setting the chart lacks"
    assert OperatorConfig.from_env({QUEUE_SETTING: "example.com/, corp/"}).kueue_excluded_resource_prefixes == \
        ("example.com/", "corp/")
    assert OperatorConfig.from_env({k: env[k] for k in PRICING_SETTINGS}).pricing == OperatorConfig().pricing
    policy = OperatorConfig.from_env({name: raw for name, (_, raw, _) in POLICY_SETTINGS.items()}).policy
    for name, (field, _, expected) in POLICY_SETTINGS.items():
        assert getattr(policy, field) == expected, name
    # the Deployment's policy is the operator's default policy
    assert OperatorConfig.from_env(env).policy == OperatorConfig().policy
    config = OperatorConfig.from_env({name: str(value) for name, (_, value) in SETTINGS.items()})
    for name, (field, value) in SETTINGS.items():
        assert getattr(config, field) == value, name
    # The Deployment's own values are the operator's defaults, and its probe/metrics ports match them.
    defaults = OperatorConfig.from_env({k: v for k, v in env.items() if v})
    assert defaults.health_port == OperatorConfig().health_port == 8080
    assert defaults.metrics_port == OperatorConfig().metrics_port == 9090
    assert (defaults.default_cpu, defaults.default_memory) == (OperatorConfig().default_cpu,
                                                                OperatorConfig().default_memory)
