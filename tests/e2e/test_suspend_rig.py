"""Suspend → checkpoint → no pods → resume at the same step, on the rig with the operator running.

kwok pods are not processes, so the trainer runs here as a real `kiln train` with the environment the
operator rendered into the PyTorchJob's pod template (the spec from its ConfigMap, the run's trainer
ServiceAccount for status). The test delivers the SIGTERM the kubelet sends when the training-operator
deletes the pods of a suspended job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kiln.control.plan import names

from tests.distributed.ranks import SAFETY_TIMEOUT_S, last_step, wait_until
from tests.integration.test_operator_lifecycle import (  # noqa: F401 - module fixtures: RBAC'd operator, namespace
    ns,
    operator,
    patch_spec,
    running_pods,
    small_run,
    status,
    submit,
    wait_phase,
)
from tests.integration.test_status_report import MICRO_MODEL

pytestmark = [pytest.mark.rig, pytest.mark.slow]


@pytest.fixture(scope="module")
def scope() -> str:
    """The RBAC of test_operator_lifecycle's `ns`/`operator` fixtures here: the cluster-wide install (the
    lifecycle tests also run the namespaced one)."""
    return "cluster"

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


def test_suspend_checkpoints_releases_every_gpu_and_resume_continues_at_the_saved_step(rig, ns, operator,  # noqa: F811 - fixtures
                                                                                      tmp_path):
    ckpt = tmp_path / "ckpt"
    body = endless_run(rig, RUN, ckpt, interval_steps=1000)
    with rig.exclusive_gpus():
        submit(rig, ns, body)
        wait_phase(rig, ns, RUN, "Running")
        env = pod_env(rig, ns, tmp_path)
        assert env["KILN_RUN_NAME"] == RUN and int(env["PET_SHUTDOWN_TIMEOUT"]) > 30
        first = Trainer(env, tmp_path / "first")
        first.wait_step(3)

        patch_spec(rig, ns, RUN, {"suspend": True})
        rig.wait_for("no pods", lambda: not running_pods(rig, ns, RUN), timeout=SAFETY_TIMEOUT_S)
        job = json.loads(rig.kubectl("get", "pytorchjob", RUN, "-n", ns, "-o", "json").stdout)
        assert job["spec"]["runPolicy"]["suspend"] is True
        assert not [pod for pod in rig.gpus_in_use() if pod.startswith(f"{ns}/")], rig.gpus_in_use()
        assert first.sigterm() == 0, first.tail()

        saved = first.records()[-1]["step"]
        assert saved >= 3 and (ckpt / "latest").read_text().strip() == f"step-{saved:08d}", first.tail()
        assert f"saved step {saved}" in first.tail()
        suspended = wait_phase(rig, ns, RUN, "Suspended")
        assert suspended["lastCheckpoint"]["step"] == saved
        assert suspended["lastCheckpoint"]["uri"] == f"file://{ckpt}/step-{saved:08d}/"

        patch_spec(rig, ns, RUN, {"suspend": False})
        rig.wait_for("the pods back", lambda: running_pods(rig, ns, RUN), timeout=SAFETY_TIMEOUT_S)
        wait_phase(rig, ns, RUN, "Running")
        second = Trainer(pod_env(rig, ns, tmp_path), tmp_path / "second")
        second.wait_step(saved + 2)
        # goodput is the operator's: the suspended minutes are lost time of their own, not productive
        ledger = rig.wait_for("goodput with the suspend in it", lambda: (s := status(rig, ns, RUN)).get("goodput")
                              and s["goodputDetail"]["lostSeconds"]["suspended"] > 0 and s, timeout=SAFETY_TIMEOUT_S)
        detail = ledger["goodputDetail"]
        assert 0 < ledger["goodput"] < 1 and detail["productiveSeconds"] > 0
        assert detail["productiveSeconds"] + sum(detail["lostSeconds"].values()) <= detail["wallSeconds"] + 0.5
        assert second.sigterm() == 0, second.tail()

    resumed = second.records()
    assert resumed[0]["step"] == saved + 1, [r["step"] for r in resumed]
    # the loss continues where it stopped: exactly what one uninterrupted run gives at that step
    ref_spec = yaml.safe_load(Path(env["KILN_SPEC"]).read_text())
    ref_spec["spec"]["checkpoint"]["uri"] = f"file://{tmp_path / 'ref-ckpt'}/"
    (tmp_path / "reference.yaml").write_text(yaml.safe_dump(ref_spec))
    ref_env = {k: v for k, v in env.items() if k not in ("KUBECONFIG", "KILN_RUN_NAME", "KILN_SHM_DIR")}
    reference = Trainer({**ref_env, "KILN_SPEC": str(tmp_path / "reference.yaml")}, tmp_path / "reference")
    try:
        reference.wait_step(saved + 1)
    finally:
        reference.sigterm()
    expected = {r["step"]: r["loss"] for r in reference.records()}
    assert resumed[0]["loss"] == pytest.approx(expected[saved + 1], rel=1e-5)
