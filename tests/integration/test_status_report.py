"""Trainer rank 0 writes TrainingSpec/status on the real apiserver, as the run's own `<run>-trainer`
ServiceAccount (the RBAC the operator renders), and an apiserver that refuses or is gone only warns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from kiln.api.spec import GROUP, PLURAL
from kiln.control.plan import names, trainer_identity
from tests.support.ranks import SAFETY_TIMEOUT_S, free_port
from tests.support.specs import MICRO_MODEL

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "manifests" / "crds" / "kiln.dev_trainingspecs.yaml"


def spec_doc(name: str, namespace: str, checkpoint: dict, steps: int) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": MICRO_MODEL, "data": {"uri": "synthetic"},
                     "training": {"steps": steps, "globalBatchSize": 4, "microBatchSize": 2, "lr": 1e-3,
                                  "warmupSteps": 0, "precision": "fp32", "logEvery": 1},
                     "parallelism": {"compile": False}, "resources": {"nodes": 1, "gpusPerNode": 0},
                     "checkpoint": checkpoint}}


def kiln_train(doc: dict, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`kiln train` of one rank, as torchrun starts it in a pod, with the pod's KILN_RUN_NAME/KILN_NAMESPACE."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
                "KILN_RUN_NAME": doc["metadata"]["name"], "KILN_NAMESPACE": doc["metadata"]["namespace"], **env}
    full_env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", str(spec),
                           "--output", str(tmp_path / "out")], env=full_env, capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S, check=False)


@pytest.mark.rig
@pytest.mark.slow
def test_rank0_reports_step_throughput_and_checkpoint_as_the_trainer_service_account(rig, namespace, tmp_path):
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    rig.kubectl("wait", "--for=condition=Established", f"--timeout={SAFETY_TIMEOUT_S}s", f"crd/{PLURAL}.{GROUP}")
    run = "status-report"
    prefix = f"s3://{rig.s3_bucket}/status-report/{uuid.uuid4().hex}/"
    doc = spec_doc(run, namespace, {"uri": prefix, "endpoint": rig.s3_endpoint, "intervalSteps": 3,
                                       "credentialsSecret": "s3-keys"}, steps=6)
    rig.apply(doc)
    rig.apply(trainer_identity(run, lambda name: {"name": name, "namespace": namespace}))
    trainer_kc = rig.kubeconfig_for_service_account(namespace, names(run)["trainer"])
    # the operator's own fields, which the trainer's merge patches must leave alone
    rig.kubectl("patch", "trainingspec", run, "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"phase": "Running", "nodes": 1}}))

    proc = kiln_train(doc, tmp_path, KUBECONFIG=str(trainer_kc), AWS_ACCESS_KEY_ID=rig.s3_access_key,
                      AWS_SECRET_ACCESS_KEY=rig.s3_secret_key)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cannot patch" not in proc.stderr, proc.stderr[-2000:]

    status = json.loads(rig.kubectl("get", "trainingspec", run, "-n", namespace, "-o", "json").stdout)["status"]
    assert (status["step"], status["progress"], status["etaSeconds"]) == (6, "100.0%", 0)
    assert status["lastCheckpoint"]["step"] == 6
    assert status["lastCheckpoint"]["uri"] == f"{prefix}step-00000006/"
    assert status["lastCheckpoint"]["time"].endswith("Z")
    assert status["tokensPerSecond"] > 0 and "mfu" not in status  # a CPU run has no known peak, so no MFU
    assert 0 < status["trainerTime"]["productiveSeconds"] and "goodput" not in status  # goodput: the operator's
    assert (status["phase"], status["nodes"]) == ("Running", 1)

    # a token of another ServiceAccount (here the namespace's default one) is refused by RBAC: one warning
    other = spec_doc(run, namespace, {"uri": f"file://{tmp_path / 'ckpt'}"}, steps=2)
    refused = kiln_train(other, tmp_path / "refused",
                         KUBECONFIG=str(rig.kubeconfig_for_service_account(namespace, "default")))
    assert refused.returncode == 0, refused.stderr[-4000:]
    assert refused.stderr.count("cannot patch the status") == 1, refused.stderr[-3000:]
    assert "HTTP 403" in refused.stderr and f"{namespace}/{run}" in refused.stderr
    after = json.loads(rig.kubectl("get", "trainingspec", run, "-n", namespace, "-o", "json").stdout)["status"]
    assert after["step"] == 6  # nothing was written with the wrong identity


@pytest.mark.slow
def test_an_unreachable_apiserver_only_warns_and_training_completes(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"https://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}]}))
    doc = spec_doc("gone", "ml", {"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": 1}, steps=3)
    proc = kiln_train(doc, tmp_path, KUBECONFIG=str(kubeconfig))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("cannot patch the status") == 1, proc.stderr[-3000:]
    assert "Connection refused" in proc.stderr and "training goes on" in proc.stderr
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000003"
