"""checkov 3.3.30 (issue 28) over what kiln ships and what it creates: the Dockerfiles, manifests/, the operator's
rendered output for every sample spec (and a replica-groups run), with each PyTorchJob's pod template as the
Pod the training-operator makes of it (checkov does not read pod templates inside a PyTorchJob), and, on the
rig, the chart as `helm template` renders it. Every failed check must be one docs/security.md lists with the
reason it is acceptable ("checkov" table), and every listed one must still fail (no stale excuses).

checkov runs offline: BC_SKIP_MAPPING and --skip-download keep it from fetching Prisma Cloud's guidelines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tools import run

REPO = Path(__file__).resolve().parents[2]
SECURITY = REPO / "docs" / "security.md"
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))
# | `CKV_K8S_11` (what it checks) | scope `Kind` | why it is acceptable |
ROW = re.compile(r"^\|\s*`(CKV2?_[A-Z0-9_]+)`[^|]*\|\s*([a-z]+) `([A-Za-z]+)`\s*\|\s*(.+?)\s*\|\s*$")


def accepted() -> dict[tuple[str, str, str], str]:
    """(check, scope, kind) -> reason, from docs/security.md's checkov table."""
    rows = {}
    for line in SECURITY.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[(m.group(1), m.group(2), m.group(3))] = m.group(4)
    return rows


def scan(checkov: Path, args: list[str]) -> set[tuple[str, str]]:
    """(check id, resource) of every failed check; the run must have produced its report."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    proc = run([checkov, *args, "--skip-download", "--quiet", "--compact", "-o", "json"], env=env, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: some check failed
    reports, text, decoder = [], proc.stdout.strip(), json.JSONDecoder()
    while text:  # one JSON document per -d (a report, or a list of them per framework)
        doc, end = decoder.raw_decode(text)
        reports += doc if isinstance(doc, list) else [doc]
        text = text[end:].strip()
    assert reports, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(f["check_id"], f["file_abs_path"], f["resource"]) for r in reports for f in r["results"]["failed_checks"]}


def pods_of(docs: list[dict]) -> list[dict]:
    """The Pods the training-operator makes of each PyTorchJob's replica templates (checkov reads Pods)."""
    pods = []
    for d in docs:
        if d.get("kind") != "PyTorchJob":
            continue
        for role, replicas in d["spec"]["pytorchReplicaSpecs"].items():
            meta = {**replicas["template"].get("metadata", {}), "name": f"{d['metadata']['name']}-{role.lower()}-0",
                    "namespace": d["metadata"]["namespace"]}
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": replicas["template"]["spec"]})
    return pods


def render(spec: Path, out: Path) -> None:
    proc = run([sys.executable, "-m", "kiln.cli.main", "render", "-n", "ml", spec])
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    out.write_text(yaml.safe_dump_all(docs + pods_of(docs)))


def findings(failed: set[tuple[str, str, str]], scope_of) -> set[tuple[str, str, str]]:
    """(check, scope, kind) of each failure: the kind is the resource's first dotted part (a Dockerfile's:
    Dockerfile)."""
    out = set()
    for check, path, resource in failed:
        kind = "Dockerfile" if "Dockerfile" in path else resource.split(".")[0]
        out.add((check, scope_of(path), kind))
    return out


def assert_listed(found: set[tuple[str, str, str]], scopes: set[str]) -> None:
    listed = {k for k in accepted() if k[1] in scopes}
    unlisted = sorted(found - set(listed))
    assert not unlisted, f"checkov failures docs/security.md does not list with a reason: {unlisted}"
    stale = sorted(set(listed) - found)
    assert not stale, f"docs/security.md lists checkov failures that no longer fail: {stale}"


def test_the_dockerfiles_manifests_and_rendered_runs_fail_only_what_security_md_accepts(checkov, tmp_path):
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for spec in SAMPLES:
        render(spec, rendered / spec.name)
    groups = yaml.safe_load((REPO / "manifests" / "samples" / "elastic-4node.yaml").read_text())
    groups["spec"]["elastic"] = {"faultTolerance": {"mode": "replicaGroups", "groups": 2}}
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(groups))
    render(tmp_path / "groups.yaml", rendered / "replica-groups.yaml")
    assert "Deployment" in (rendered / "replica-groups.yaml").read_text()  # the lighthouse is scanned too

    failed = scan(checkov, ["--framework", "kubernetes", "dockerfile", "-d", str(REPO / "manifests"),
                            "-d", str(rendered), "-d", str(REPO / "images")])

    def scope(path: str) -> str:
        return "dockerfile" if "Dockerfile" in path else "rendered" if path.startswith(str(rendered)) else "manifests"

    assert_listed(findings(failed, scope), {"dockerfile", "manifests", "rendered"})


@pytest.mark.rig
def test_the_chart_fails_only_what_security_md_accepts(checkov, rig, tmp_path):
    from tests.rig import versions

    proc = subprocess.run([str(rig.bin / "helm"), "template", "kiln", str(REPO / "helm" / "kiln"), "--namespace",
                           "kiln-system", "--kube-version", versions.KUBERNETES], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "chart").mkdir()
    (tmp_path / "chart" / "kiln.yaml").write_text(proc.stdout)
    failed = scan(checkov, ["--framework", "kubernetes", "-d", str(tmp_path / "chart")])
    assert_listed(findings(failed, lambda path: "chart"), {"chart"})


def test_the_accepted_table_parses_and_names_real_checks():
    rows = accepted()
    assert len(rows) == sum(1 for line in SECURITY.read_text().splitlines() if line.startswith("| `CKV"))
    assert rows and all(reason.strip() for reason in rows.values())
    assert {scope for _, scope, _ in rows} <= {"dockerfile", "manifests", "rendered", "chart"}
