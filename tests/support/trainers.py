"""Trainer processes that stand in for kwok pods (kwok pods are not processes): a real `kiln train` with the
environment the operator rendered into the PyTorchJob's pod template (pod_env), an endless micro-model run to
stop and resume (endless_run), and the autouse fixture that stops a failed test's trainers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.control.plan import names
from tests.support.ranks import SAFETY_TIMEOUT_S, last_step, wait_until
from tests.support.specs import MICRO_MODEL, small_run


RUN = "suspend"


def pod_env(rig, namespace: str, tmp_path: Path, run: str = RUN) -> dict[str, str]:
    """The trainer container's environment as the PyTorchJob renders it, mapped onto this machine."""
    job = json.loads(rig.kubectl("get", "pytorchjob", run, "-n", namespace, "-o", "json").stdout)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["KILN_NAMESPACE"] = namespace  # valueFrom metadata.namespace
    cm = json.loads(rig.kubectl("get", "configmap", names(run)["configmap"], "-n", namespace, "-o", "json").stdout)
    spec = tmp_path / "spec.yaml"  # the ConfigMap mounted at /etc/kiln
    spec.write_text(cm["data"]["spec.yaml"])
    env["KILN_SPEC"] = str(spec)
    env["KILN_SHM_DIR"] = str(tmp_path / "shm")  # the pod's /dev/shm/kiln, private to this test
    env["KUBECONFIG"] = str(rig.kubeconfig_for_service_account(namespace, names(run)["trainer"]))
    return env


def endless_run(rig, run: str, ckpt: Path, interval_steps: int) -> dict:
    """A micro-model run on one kwok GPU node that trains until stopped, committing to `ckpt`."""
    body = small_run(run, model=MICRO_MODEL,
                     training={"steps": 100000, "globalBatchSize": 4, "microBatchSize": 2, "lr": 1e-3,
                               "warmupSteps": 0, "precision": "fp32", "logEvery": 1},
                     parallelism={"compile": False},
                     checkpoint={"uri": f"file://{ckpt}/", "intervalSteps": interval_steps})
    body["spec"]["resources"]["gpuType"] = rig.gpu_product
    return body


class Trainer:
    """One rank of `kiln train`, as torchrun starts it in the pod."""

    started: list[Trainer] = []  # every trainer a test started; `no_trainer_outlives_its_test` stops them

    def __init__(self, env: dict[str, str], out: Path):
        self.out = out
        full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        full.pop("KUBERNETES_SERVICE_HOST", None)
        self.log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - outlives this call, like the process
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "train", "--config", env["KILN_SPEC"],
                                      "--output", str(out)], env=full, stdout=self.log, stderr=subprocess.STDOUT)
        Trainer.started.append(self)

    def records(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_step(self, step: int) -> None:
        """Until the trainer reports `step`; it must not exit first (the timeout is only a hang guard)."""
        wait_until(f"trainer step {step}", lambda: last_step(self.out / "metrics.jsonl") >= step,
                   alive=lambda: self.proc.poll() is None, context=self.tail)

    def sigterm(self, timeout: float = SAFETY_TIMEOUT_S) -> int:
        self.proc.send_signal(signal.SIGTERM)  # the kubelet, when the pod is deleted
        rc = self.proc.wait(timeout=timeout)
        self.log.close()
        return rc

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.out.parent / f"{self.out.name}.log").read_text()[-3000:]


@pytest.fixture(autouse=True)
def no_trainer_outlives_its_test():
    """A test that fails midway leaves its trainers running (the kubelet that would stop them is the test): stop
    them, so that an endless run does not hold its rendezvous port and a core for the rest of the session."""
    yield
    while Trainer.started:
        trainer = Trainer.started.pop()
        if trainer.proc.poll() is None:
            trainer.proc.kill()
            trainer.proc.wait()
        trainer.log.close()
