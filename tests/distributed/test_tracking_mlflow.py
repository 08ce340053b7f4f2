"""Experiment tracking against a real MLflow server (tests/mlflow_server.py): one tracked run across a resume,
with no duplicated or missing steps; a tracker that is down never stops training."""

from __future__ import annotations

import shutil
from pathlib import Path

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


@pytest.fixture(scope="module")
def tracked_run(mlflow, tmp_path_factory):
    """A 2-step run tracked in MLflow (experiment "export"), trained once for the export tests."""
    tmp = tmp_path_factory.mktemp("tracked-run")
    spec = write_spec(tmp / "spec.yaml", training={"steps": 2},
                      tracking={"mlflow": {"uri": mlflow.uri, "experiment": "export"}})
    run(spec, tmp / "out", 2)
    return spec, tmp / "out"


def test_export_track_logs_the_model_to_the_runs_tracked_run_and_transformers_loads_it_back(mlflow, tracked_run,
                                                                                          tmp_path):
    import hashlib

    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    spec, out = tracked_run
    export = tmp_path / "export"
    (export / "unrelated.txt").parent.mkdir()
    (export / "unrelated.txt").write_text("not the export's")  # a file already there is not logged
    proc = kiln("export", str(spec), "--run-output", str(out), "--output", f"file://{export}", "--track")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

    client = MlflowClient(mlflow.uri)
    [tracked] = client.search_runs([client.get_experiment_by_name("export").experiment_id])
    run_id = tracked.info.run_id  # the training run's own tracked run: no second run was made
    assert f"kiln: tracked: mlflow run {run_id}" in proc.stdout
    assert tracked.data.tags["kiln.exported_step"] == "2"
    exported = {p.name for p in export.iterdir()} - {"unrelated.txt"}
    assert {a.path.removeprefix("model/") for a in client.list_artifacts(run_id, "model")} == exported

    back = Path(client.download_artifacts(run_id, "model", str(tmp_path / "back")))
    for name in exported:  # byte for byte what kiln export wrote
        assert hashlib.sha256((back / name).read_bytes()).digest() == \
            hashlib.sha256((export / name).read_bytes()).digest(), name
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_mlflow = AutoModelForCausalLM.from_pretrained(back).eval()(tokens).logits
        from_export = AutoModelForCausalLM.from_pretrained(export).eval()(tokens).logits
    torch.testing.assert_close(from_mlflow, from_export, rtol=0, atol=0)


def test_export_track_of_a_run_never_tracked_says_so_and_keeps_the_export(tracked_run, tmp_path):
    spec, out = tracked_run
    untracked = tmp_path / "untracked"  # the same commits, without the tracked run's id
    shutil.copytree(out / "checkpoints", untracked / "checkpoints", ignore=shutil.ignore_patterns("tracking"))
    export = tmp_path / "export"
    proc = kiln("export", str(spec), "--run-output", str(untracked), "--output", f"file://{export}", "--track")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "spec.tracking.mlflow" in last and "tracking/mlflow.json" in last, proc.stderr[-2000:]
    assert f"the export itself is at file://{export}" in last
    assert (export / "config.json").exists()  # what was exported stays
