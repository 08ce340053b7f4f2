"""The release pipeline (issue 28, pipelines/ci/github/release.yaml): actionlint and GitHub's workflow schema pass
it; on a tag it builds what the rig builds (tests/rig/images.py: the same Dockerfiles, context and build
arguments, pushed under the names the chart runs), signs images and chart keylessly, attaches SBOMs, and pins the
chart to the pushed digests (record-digests.sh, run here on a copy of the chart)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.rig.images import build_args, image_refs
from tests.tools import run

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "pipelines" / "ci" / "github" / "release.yaml"
RECORD = REPO / "pipelines" / "ci" / "github" / "record-digests.sh"
OPERATOR_DIGEST, TRAINER_DIGEST = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def workflow() -> dict:
    return yaml.safe_load(RELEASE.read_text())


def steps(job: str) -> list[dict]:
    return workflow()["jobs"][job]["steps"]


def test_release_passes_actionlint(actionlint):
    proc = run([actionlint, "-no-color", RELEASE])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_release_matches_githubs_workflow_schema():
    proc = run([shutil.which("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", RELEASE])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_tag_builds_what_the_rig_builds_under_the_names_the_chart_runs():
    flow = workflow()
    assert flow[True]["push"]["tags"] == ["v*"]  # PyYAML reads the key `on` as True
    matrix = flow["jobs"]["images"]["strategy"]["matrix"]["include"]
    build = next(s for s in steps("images") if str(s.get("uses", "")).startswith("docker/build-push-action"))["with"]
    refs = image_refs()  # what the chart's defaults and the rig's build name
    assert sorted(m["name"] for m in matrix) == sorted(refs)
    for m in matrix:
        name = m["name"]
        assert build["file"].replace("${{ matrix.name }}", name) == f"images/{name}/Dockerfile"
        assert (REPO / "images" / name / "Dockerfile").is_file()
        tag = build["tags"].replace("${{ matrix.name }}", name)
        assert tag.split(":")[0] == refs[name].split(":")[0], (tag, refs[name])
        assert "linux/amd64" in m["platforms"].split(",")
    assert [m["platforms"] for m in matrix if m["name"] == "operator"] == ["linux/amd64,linux/arm64"]
    assert build["context"] == "."
    args = dict(line.split("=", 1) for line in build["build-args"].splitlines())
    assert set(args) == set(build_args())  # the rig's build arguments, none more
    assert build["push"] is True and build["sbom"] is True


def test_images_and_chart_are_signed_keylessly_and_ship_sboms():
    jobs = workflow()["jobs"]
    for job in ("images", "chart"):
        assert jobs[job]["permissions"]["id-token"] == "write"  # cosign keyless: the workflow's OIDC identity
        assert any(str(s.get("uses", "")).startswith("sigstore/cosign-installer") for s in jobs[job]["steps"])
    image_runs = "\n".join(s.get("run", "") for s in steps("images"))
    assert 'cosign sign --yes "$IMAGE@$DIGEST"' in image_runs  # by digest: a tag can move
    assert "cosign attest --yes --type spdxjson" in image_runs
    assert any(str(s.get("uses", "")).startswith("anchore/sbom-action") for s in steps("images"))
    chart_runs = "\n".join(s.get("run", "") for s in steps("chart"))
    assert 'helm push "dist/kiln-$VERSION.tgz" "$CHARTS"' in chart_runs and workflow()["env"]["CHARTS"].startswith("oci://")
    assert 'cosign sign --yes "ghcr.io/kiln-dev/charts/kiln@$DIGEST"' in chart_runs
    # the digests are recorded before the chart is packaged
    order = [s.get("name", "") for s in steps("chart")]
    assert order.index("Record the image digests in the chart") < order.index("Package and push the chart")
    assert "record-digests.sh helm/kiln/values.yaml" in chart_runs


def test_record_digests_pins_both_images_in_a_chart_that_still_validates(tmp_path):
    chart = tmp_path / "kiln"
    shutil.copytree(REPO / "helm" / "kiln", chart)
    env = {"PATH": "/usr/bin:/bin", "OPERATOR_DIGEST": OPERATOR_DIGEST, "TRAINER_DIGEST": TRAINER_DIGEST}
    proc = run(["bash", RECORD, chart / "values.yaml"], env=env)
    assert proc.returncode == 0, proc.stderr
    values = yaml.safe_load((chart / "values.yaml").read_text())
    app = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    # the Deployment renders repository:tag; the plan runs trainer.image as it is
    assert image_refs()["operator"].endswith(f":{app}")  # the chart's default tag is its appVersion
    assert f"{values['image']['repository']}:{values['image']['tag']}" == f"{image_refs()['operator']}@{OPERATOR_DIGEST}"
    assert values["trainer"]["image"] == f"{image_refs()['trainer']}@{TRAINER_DIGEST}"
    proc = run([shutil.which("check-jsonschema"), "--schemafile", chart / "values.schema.json", chart / "values.yaml"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # nothing else changed
    before = (REPO / "helm" / "kiln" / "values.yaml").read_text().splitlines()
    after = (chart / "values.yaml").read_text().splitlines()
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == \
        [before.index('  tag: ""'), before.index(f"  image: {image_refs()['trainer']}")]


@pytest.mark.parametrize("digest", ["latest", "sha256:abc", ""])
def test_record_digests_refuses_what_is_not_a_digest(tmp_path, digest):
    values = tmp_path / "values.yaml"
    shutil.copy(REPO / "helm" / "kiln" / "values.yaml", values)
    shutil.copy(REPO / "helm" / "kiln" / "Chart.yaml", tmp_path / "Chart.yaml")
    proc = run(["bash", RECORD, values], env={"PATH": "/usr/bin:/bin", "OPERATOR_DIGEST": digest,
                                              "TRAINER_DIGEST": TRAINER_DIGEST})
    assert proc.returncode == 1 and "not an image digest" in proc.stderr
    assert values.read_text() == (REPO / "helm" / "kiln" / "values.yaml").read_text()
