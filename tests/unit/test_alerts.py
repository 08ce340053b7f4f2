"""kiln's alert rules, evaluated by Prometheus's own rule engine (promtool, built from the prometheus Go module):
they parse, each fires on the series a failing run produces and stays quiet on a healthy one, and each reads
only metrics kiln exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kiln.control import metrics as op
from tests import prometheus
from tests.prometheus import RULES
from tests.support.metrics import exported_names
from tests.tools import run

RULE_TESTS = Path(__file__).resolve().parents[1] / "alerts" / "kiln-alerts.test.yaml"


@pytest.fixture(scope="session")
def promtool() -> Path:
    return prometheus.promtool()


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.slow  # cold: builds promtool once into $KILN_CACHE_DIR/tools
def test_the_rules_file_is_valid_prometheus(promtool):
    proc = run([promtool, "check", "rules", RULES])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(alerts())} rules found" in proc.stdout


@pytest.mark.slow
def test_each_alert_fires_on_a_failing_run_and_not_on_a_healthy_one(promtool):
    proc = run([promtool, "test", "rules", RULE_TESTS], cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {a["alert"] for a in alerts()}, "an alert without a test that makes it fire"


def test_the_rules_read_only_metrics_kiln_exports():
    # by family: a labelled counter has no sample before its first increment (no reconcile error yet)
    family = lambda name: re.sub(r"_(bucket|count|sum|total|created)$", "", name)  # noqa: E731
    names = {family(n) for n in exported_names()} | {family(f.name) for f in op.REGISTRY.collect()}
    used = {family(m) for a in alerts() for m in re.findall(r"\bkiln_[a-z_]+", a["expr"])}
    assert used and used <= names, f"rules on metrics nobody exports: {sorted(used - names)}"


def test_every_page_and_warning_says_what_to_look_at():
    for alert in alerts():
        assert alert["labels"]["severity"] in ("page", "warning"), alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
