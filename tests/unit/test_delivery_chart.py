"""The Helm chart's sources: CRD and RBAC equal manifests/' files, the values match their schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from kiln.api import generate
from kiln.cli.main import main
from tests.rig import versions

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kiln"


@pytest.mark.parametrize("path", sorted(generate.outputs(REPO)))
def test_generated_files_are_current(path):
    # The CRD (from the models and rules), its chart copy, the chart's copies of manifests/rbac (Helm reads only
    # files inside the chart) and the field reference of docs/api.md: one command writes them all.
    assert (REPO / path).read_text() == generate.outputs(REPO)[path], f"{path} is stale: run `{generate.COMMAND}`"


def test_kiln_crd_prints_the_checked_in_crd(capsys):
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (REPO / generate.CRD).read_text(), f"stale: run `{generate.COMMAND}`"


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
