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
    "KILN_TRAINER_METRICS_PORT": ("trainer_metrics_port", 19400),
}


def deployment_env() -> dict[str, str]:
    container = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]
    # POD_ID (kopf's identity, from the downward API) is kopf's own setting, not kiln's
    return {e["name"]: e.get("value") for e in container["env"] if e["name"] != "POD_ID"}


def test_every_deployment_variable_is_an_operator_setting():
    env = deployment_env()
    assert set(env) == set(SETTINGS), "a variable the operator does not read, or a setting the chart lacks"
    config = OperatorConfig.from_env({name: str(value) for name, (_, value) in SETTINGS.items()})
    for name, (field, value) in SETTINGS.items():
        assert getattr(config, field) == value, name
    # The Deployment's own values are the operator's defaults, and its probe/metrics ports match them.
    defaults = OperatorConfig.from_env({k: v for k, v in env.items() if v})
    assert defaults.health_port == OperatorConfig().health_port == 8080
    assert defaults.metrics_port == OperatorConfig().metrics_port == 9090
    assert (defaults.default_cpu, defaults.default_memory) == (OperatorConfig().default_cpu,
                                                                OperatorConfig().default_memory)
