"""MLflow's artifact store on the rig's S3: a real MLflow server (tests/mlflow_server.py) whose artifacts go to
s3://<the rig's bucket>/<prefix> (versitygw), a short run tracked into it, and `kiln export --track`. The model
lands in the bucket byte for byte (read back through the S3 API with the minio client, not through MLflow), and
MLflow's REST API lists the same files as the run's artifacts. kiln and MLflow's client never hold the S3 keys:
the server proxies the uploads."""

from __future__ import annotations

import hashlib
import json
import urllib.parse
import urllib.request
import uuid

import pytest

from kiln.storage import open_store
from tests import mlflow_server
from tests.support.runs import kiln, write_spec

pytestmark = [pytest.mark.rig, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(rig, tmp_path_factory):
    prefix = f"test-mlflow/{uuid.uuid4().hex[:8]}"
    artifacts = mlflow_server.S3Artifacts(f"s3://{rig.s3_bucket}/{prefix}", rig.s3_endpoint, rig.s3_access_key,
                                          rig.s3_secret_key)
    started = mlflow_server.start(tmp_path_factory.mktemp("mlflow-s3"), artifacts)
    try:
        yield started, prefix
    finally:
        started.stop()
        store = open_store(f"s3://{rig.s3_bucket}/{prefix}/", endpoint=rig.s3_endpoint,
                           env={"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key})
        store.delete_prefix("")


def rest(uri: str, api: str, query: dict) -> dict:
    """A GET of MLflow's REST API."""
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/{api}?{urllib.parse.urlencode(query)}", timeout=30) as response:
        return json.load(response)


def search(uri: str, experiment_id: str) -> list[dict]:
    """runs/search is a POST in MLflow's REST API."""
    body = json.dumps({"experiment_ids": [experiment_id]}).encode()
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/search", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["runs"]


def test_export_track_puts_the_model_in_the_rigs_s3_and_mlflow_lists_it(rig, server, tmp_path):
    mlflow, prefix = server
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 2},
                      tracking={"mlflow": {"uri": mlflow.uri, "experiment": "s3-artifacts"}})
    out, export = tmp_path / "out", tmp_path / "export"
    trained = kiln("run", str(spec), "--nproc", "1", "--steps", "2", "--output", str(out))
    assert trained.returncode == 0, trained.stderr[-4000:]
    proc = kiln("export", str(spec), "--run-output", str(out), "--output", f"file://{export}", "--track")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    exported = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in export.iterdir()}
    assert "config.json" in exported and any(name.endswith(".safetensors") for name in exported)

    experiment = rest(mlflow.uri, "experiments/get-by-name", {"experiment_name": "s3-artifacts"})
    [run] = search(mlflow.uri, experiment["experiment"]["experiment_id"])  # the training run's tracked run, alone
    run_id = run["info"]["run_id"]
    assert f"kiln: tracked: mlflow run {run_id}" in proc.stdout
    listed = rest(mlflow.uri, "artifacts/list", {"run_id": run_id, "path": "model"})["files"]
    assert {f["path"].removeprefix("model/"): int(f["file_size"]) for f in listed} == \
        {name: (export / name).stat().st_size for name in exported}

    # the bytes are in the rig's bucket, under the server's prefix and this run's id
    client = rig.minio_client()
    objects = {o.object_name.rpartition(f"{run_id}/artifacts/model/")[2]: o.object_name
               for o in client.list_objects(rig.s3_bucket, prefix=f"{prefix}/", recursive=True)
               if f"{run_id}/artifacts/model/" in o.object_name}
    assert set(objects) == set(exported), sorted(objects)
    for name, key in objects.items():
        response = client.get_object(rig.s3_bucket, key)
        try:
            assert hashlib.sha256(response.read()).hexdigest() == exported[name], name
        finally:
            response.close()
            response.release_conn()

