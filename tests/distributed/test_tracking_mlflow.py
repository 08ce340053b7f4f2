"""Experiment tracking against a real MLflow server (tests/mlflow_server.py): one tracked run across a resume,
with no duplicated or missing steps; a tracker that is down never stops training."""

from __future__ import annotations

import shutil

import pytest

from tests import mlflow_server
from tests.support.runs import kiln, read_metrics, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    server = mlflow_server.start(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def run(spec, out, steps: int):
    proc = kiln("run", str(spec), "--nproc", "1", "--steps", str(steps), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_a_resumed_run_continues_one_mlflow_run_without_duplicated_or_missing_steps(mlflow, tmp_path):
    from mlflow.tracking import MlflowClient

    # A constant learning rate: the rerun's longer target (8 steps) does not change steps 3-6.
    spec = write_spec(tmp_path / "spec.yaml", checkpoint={"intervalSteps": 2}, training={"schedule": "constant"},
                      tracking={"mlflow": {"uri": mlflow.uri, "experiment": "resume"}})
    out = tmp_path / "out"
    run(spec, out, 6)  # commits at 2, 4 and 6
    # As if killed after step 6 before the commits of steps 4 and 6 landed: the rerun resumes at step 2
    # and steps 3-6 run again (bit for bit), after the tracked run already holds them.
    for step in (4, 6):
        shutil.rmtree(out / "checkpoints" / f"step-{step:08d}")
    rerun = run(spec, out, 8)
    assert "step 3/8" in rerun.stdout and "step 1/8" not in rerun.stdout  # it resumed at the commit of step 2

    client = MlflowClient(mlflow.uri)
    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # the restart continued the same tracked run
    tracked = runs[0]
    history = client.get_metric_history(tracked.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))  # every step once
    logged = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert {m.step: m.value for m in history} == pytest.approx(logged, abs=1e-6)
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["training.globalBatchSize"] == "4"
    assert tracked.data.tags["kiln.last_checkpoint_step"] == "8"
    assert (out / "checkpoints" / "tracking" / "mlflow.json").exists()


def test_a_tracker_that_is_down_says_so_once_and_training_finishes(tmp_path):
    from tests.support.ranks import free_port

    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 6},
                      tracking={"mlflow": {"uri": down, "experiment": "down"}})
    out = tmp_path / "out"
    proc = run(spec, out, 6)
    assert proc.stderr.count("kiln: tracking: mlflow is not reachable") == 1, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
