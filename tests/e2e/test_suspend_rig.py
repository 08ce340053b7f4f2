"""Suspend → checkpoint → no pods → resume at the same step, on the rig with the operator running.

kwok pods are not processes, so the trainer runs here as a real `kiln train` with the environment the
operator rendered into the PyTorchJob's pod template (the spec from its ConfigMap, the run's trainer
ServiceAccount for status). The test delivers the SIGTERM the kubelet sends when the training-operator
deletes the pods of a suspended job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.operator import (  # noqa: F401 - fixtures
    ns, operator, patch_spec, running_pods, status, submit, wait_phase,
)
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.trainers import (  # noqa: F401 - fixtures
    RUN, Trainer, endless_run, no_trainer_outlives_its_test, pod_env,
)

pytestmark = [pytest.mark.rig, pytest.mark.slow]


@pytest.fixture(scope="module")
def scope() -> str:
    """The RBAC of test_operator_lifecycle's `ns`/`operator` fixtures here: the cluster-wide install (the
    lifecycle tests also run the namespaced one)."""
    return "cluster"


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
