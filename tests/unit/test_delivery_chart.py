"""The Helm chart's sources: CRD and RBAC equal manifests/' files, the values match their schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from kiln.cli.main import main
from tests.rig import versions

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kiln"


def test_chart_crd_is_what_kiln_crd_prints(capsys):
    assert main(["crd"]) == 0
    generated = capsys.readouterr().out
    chart_crd = CHART / "crds" / "kiln.dev_trainingspecs.yaml"
    assert chart_crd.read_text() == generated, "regenerate: kiln crd > manifests/crds/kiln.dev_trainingspecs.yaml"


@pytest.mark.parametrize("copy,source", [
    ("crds/kiln.dev_trainingspecs.yaml", "manifests/crds/kiln.dev_trainingspecs.yaml"),
    ("files/operator-clusterrole.yaml", "manifests/rbac/operator-clusterrole.yaml"),
    ("files/trainer-clusterrole.yaml", "manifests/rbac/trainer-clusterrole.yaml"),
])
def test_chart_copies_of_crd_and_rbac_equal_manifests(copy, source):
    # Helm reads only files inside the chart (symlinks work but warn on every command), so the chart holds
    # copies; manifests/ is the source, and the chart renders its RBAC rules from these copies verbatim.
    assert (CHART / copy).read_text() == (REPO / source).read_text(), f"cp {source} helm/kiln/{copy}"


def test_default_values_match_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


def test_chart_versions_follow_the_package_and_the_rig_kubernetes_is_supported():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    from kiln import __version__

    assert chart["appVersion"] == __version__
    low = re.fullmatch(r">=(\d+)\.(\d+)\.(\d+)-0", chart["kubeVersion"])
    assert low, chart["kubeVersion"]
    rig = tuple(int(x) for x in versions.KUBERNETES.lstrip("v").split("."))
    assert rig >= tuple(int(x) for x in low.groups())
