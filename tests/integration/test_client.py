"""kiln.client against the rig's real apiserver: README's CI flow (validate, submit, wait, status) from Python,
with the same errors as the CLI. The run's status is written here as the operator and the trainer would."""

from __future__ import annotations

import json
import uuid

import pytest

from kiln.api.load import parse
from kiln.client import KilnClient, RunFailed
from kiln.errors import KilnError
from tests.rig.install import install_crd
from tests.support.specs import small_run

pytestmark = pytest.mark.rig


@pytest.fixture
def client(rig):
    install_crd(rig)
    ns = f"kiln-client-{uuid.uuid4().hex[:8]}"
    rig.kubectl("create", "namespace", ns)
    try:
        yield KilnClient(ns, kubeconfig=str(rig.kubeconfig))
    finally:
        rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def set_status(rig, client: KilnClient, name: str, status: dict) -> None:
    rig.kubectl("patch", "trainingspec", name, "-n", client.namespace, "--subresource=status", "--type", "merge",
                "-p", json.dumps({"status": status}))


def test_the_ci_flow_from_python(rig, client):
    spec = client.validate(parse(small_run("from-python")))
    name = client.submit(spec)
    assert name == "from-python"
    assert client.get(name)["spec"]["training"]["steps"] == 100  # what the apiserver holds
    set_status(rig, client, name, {"phase": "Running", "step": 7, "goodput": 0.9})
    status = client.wait(name, "Running", timeout=60, interval=0.2)
    assert (status.phase, status.step, status.goodput) == ("Running", 7, 0.9)
    with pytest.raises(TimeoutError, match="still Running"):
        client.wait(name, "Succeeded", timeout=0)
    set_status(rig, client, name, {"phase": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "rank 0 exited 1",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
    with pytest.raises(RunFailed, match="Failed \\(waited for Succeeded\\): rank 0 exited 1"):
        client.wait(name, "Succeeded", timeout=60, interval=0.2)
    assert [item["metadata"]["name"] for item in client.list()] == [name]


def test_bad_input_gets_the_clis_errors(client):
    with pytest.raises(KilnError, match="parallelism.tensor"):
        client.validate(parse(small_run("bad", parallelism={"tensor": 3}, resources={"gpusPerNode": 8})))
    with pytest.raises(KilnError, match="no TrainingSpec 'nothing-here'"):
        client.status("nothing-here")
