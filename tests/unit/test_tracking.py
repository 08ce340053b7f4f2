"""The tracking queue (kiln.trainer.observe.tracking): a step never waits for a tracker, drops are counted, a
tracker's failure is said once, and the run id is kept in the run's store so a restart continues the tracked run."""

from __future__ import annotations

import threading

from kiln.storage.store import FileStore
from kiln.trainer.observe.tracking import Tracking, flat_params, numeric_metrics


class GatedTracker:
    """A tracker whose calls wait until the test opens the gate: a tracker that is slow for as long as we like."""

    name = "gated"

    def __init__(self, fail: bool = False):
        self.gate, self.calls, self.fail = threading.Event(), [], fail
        self.opened_with: list = []

    def open(self, run_id, params):
        self.gate.wait()
        self.opened_with.append(run_id)
        return run_id or "run-1"

    def log(self, step, metrics):
        if self.fail:
            raise ConnectionError("connection refused\nsecond line")
        self.calls.append(("log", step, metrics))

    def committed(self, step, uri):
        self.calls.append(("committed", step, uri))

    def close(self, ok):
        self.calls.append(("close", ok))


def test_offers_never_wait_for_a_stuck_tracker_and_drops_are_counted(tmp_path):
    tracker = GatedTracker()
    tracking = Tracking([tracker], params={}, store=FileStore(tmp_path), capacity=3)
    for step in range(1, 9):  # the sender is stuck in open(): 3 queued, 5 dropped, and no offer blocked
        tracking.offer({"step": step, "loss": 1.0})
    assert tracking.dropped == 5
    record = {"step": 9, "loss": 1.0}
    tracking.annotate(record)
    tracking.offer(record)
    assert record["tracking_dropped"] == 5 and tracking.dropped == 6
    tracker.gate.set()
    tracking.close(ok=True)
    assert [c[1] for c in tracker.calls if c[0] == "log"] == [1, 2, 3]
    assert tracker.calls[-1] == ("close", True)


def test_a_failing_tracker_is_said_once_and_noted_in_the_records(tmp_path, capsys):
    tracker = GatedTracker(fail=True)
    tracker.gate.set()
    tracking = Tracking([tracker], params={}, store=FileStore(tmp_path))
    for step in (1, 2, 3):
        tracking.offer({"step": step, "loss": 1.0})
    tracking.close()
    record = {"step": 4, "loss": 1.0}
    tracking.annotate(record)
    assert record["tracking_error"] == "gated: connection refused"
    assert capsys.readouterr().err.count("kiln: tracking: gated is not reachable") == 1


def test_the_run_id_is_kept_in_the_store_and_reused_by_a_restart(tmp_path):
    store = FileStore(tmp_path)
    first = GatedTracker()
    first.gate.set()
    Tracking([first], params={}, store=store).close()
    again = GatedTracker()
    again.gate.set()
    Tracking([again], params={}, store=store).close()
    assert first.opened_with == [None] and again.opened_with == ["run-1"]


def test_each_commit_is_sent_once():
    tracker = GatedTracker()
    tracker.gate.set()
    tracking = Tracking([tracker], params={})
    for ref in (None, {"step": 4, "uri": "u4"}, {"step": 4, "uri": "u4"}, {"step": 8, "uri": "u8"}):
        tracking.commit(ref)
    tracking.close()
    assert [c for c in tracker.calls if c[0] == "committed"] == [("committed", 4, "u4"), ("committed", 8, "u8")]


def test_params_and_metrics_are_flattened_as_trackers_show_them():
    assert flat_params({"training": {"lr": 0.001, "steps": 4}, "elastic": {"plan": [{"nodes": 2}]}}) == {
        "training.lr": "0.001", "training.steps": "4", "elastic.plan.0.nodes": "2"}
    assert numeric_metrics({"step": 3, "loss": 2.5, "mfu": None, "world": "pp1", "startup": {"restored": 7.0},
                            "ok": True}) == {"loss": 2.5, "startup.restored": 7.0}


def test_the_pods_get_tracking_credentials_by_reference_only():
    from kiln.api.load import parse
    from kiln.control.config import OperatorConfig
    from kiln.control.plan import plan

    from tests.support.specs import with_

    raw = with_({"tracking": {"mlflow": {"uri": "http://mlflow:5000", "credentialsSecret": "mlflow-creds"},
                              "wandb": {"project": "p", "credentialsSecret": "wandb-creds"}}})
    raw["metadata"].update(namespace="ml", uid="5b1c8e0c-0000-4000-8000-000000000001")
    result = plan(parse(raw), None, OperatorConfig(image="registry.test/trainer:1"))
    job = next(o for o in result.objects if o["kind"] == "PyTorchJob")
    env = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if e["name"].startswith(("MLFLOW_", "WANDB_"))}
    assert refs == {
        "MLFLOW_TRACKING_TOKEN": {"name": "mlflow-creds", "key": "MLFLOW_TRACKING_TOKEN", "optional": True},
        "MLFLOW_TRACKING_USERNAME": {"name": "mlflow-creds", "key": "MLFLOW_TRACKING_USERNAME", "optional": True},
        "MLFLOW_TRACKING_PASSWORD": {"name": "mlflow-creds", "key": "MLFLOW_TRACKING_PASSWORD", "optional": True},
        "WANDB_API_KEY": {"name": "wandb-creds", "key": "WANDB_API_KEY", "optional": True},
    }
    assert all("value" not in e for e in env if e["name"] in refs)


def test_a_tracking_uri_must_be_http_or_file():
    import pytest

    from kiln.api.load import parse
    from kiln.errors import KilnError
    from tests.support.specs import with_

    with pytest.raises(KilnError, match=r"spec\.tracking\.mlflow\.uri: String should match"):
        parse(with_({"tracking": {"mlflow": {"uri": "mlflow:5000"}}}))


def test_wandb_offline_writes_a_run_that_wandb_sync_accepts_and_a_restart_continues_it(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from kiln.trainer.observe.tracking import WandbTracker

    store = FileStore(tmp_path / "checkpoints")
    for steps in ((1, 2, 3), (4, 5)):  # a run and its restart
        tracking = Tracking([WandbTracker("kiln-test", None, "offline", "t", str(tmp_path))],
                            params={"training.lr": "0.001"}, store=store)
        for step in steps:
            tracking.offer({"step": step, "loss": 1.0 / step})
        tracking.close(timeout=600)  # returns once W&B finished (a loaded machine can take more than 30 s)
        assert tracking.errors == {} and tracking.dropped == 0
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run_ids = {path.stem.removeprefix("run-") for path in runs}
    assert len(run_ids) == 1  # the restart wrote to the same W&B run id, kept in the store
    assert (tmp_path / "checkpoints" / "tracking" / "wandb.json").exists()
    wandb_cli = Path(sys.executable).parent / "wandb"
    proc = subprocess.run([str(wandb_cli), "sync", "--dry-run", *map(str, {p.parent for p in runs})],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"Would sync {len(runs)} run(s)" in proc.stdout + proc.stderr, proc.stderr


def test_a_tracker_that_is_down_is_in_the_status_at_once():
    from kiln.api.spec import TrainingSpecStatus
    from kiln.trainer.observe.status_report import StatusReporter
    from kiln.trainer.observe.tracking import MlflowTracker

    from tests.support.ranks import free_port, wait_until
    from tests.support.status import Clock, FakeSender, record

    down = MlflowTracker(f"http://127.0.0.1:{free_port()}", "e", "run")  # the real client; nothing listens
    tracking = Tracking([down], params={})
    wait_until("the tracker's first failure", lambda: tracking.errors)
    clock, sender = Clock(), FakeSender()
    reporter = StatusReporter(10, sender=sender, every_s=10.0, clock=clock)
    reporter.update(record(1), {})
    for step in (2, 3):  # a second after the last report: only the news of the failure goes out, once
        clock.t += 1.0
        rec = record(step)
        tracking.annotate(rec)
        reporter.update(rec, {})
    tracking.close()
    assert [b["status"]["step"] for b in sender.bodies] == [1, 2]
    status = sender.bodies[1]["status"]["tracking"]
    assert status["dropped"] == 0 and status["error"].startswith("mlflow: ")
    TrainingSpecStatus.model_validate(sender.bodies[1]["status"])
    assert "tracking" not in sender.bodies[0]["status"]  # absent while tracking is well


def test_dropped_records_are_in_the_status_from_the_first_drop():
    from kiln.trainer.observe.status_report import StatusReporter

    from tests.support.status import Clock, FakeSender, record

    stuck = GatedTracker()
    tracking = Tracking([stuck], params={}, capacity=1)
    clock, sender = Clock(), FakeSender()
    reporter = StatusReporter(10, sender=sender, every_s=10.0, clock=clock)
    for step in range(1, 5):  # the sender is stuck in open(): step 1 queued, 2 and 3 dropped
        clock.t += 1.0
        rec = record(step)
        tracking.annotate(rec)
        reporter.update(rec, {})
        tracking.offer(rec)
    reporter.close({})
    stuck.gate.set()
    tracking.close()
    # step 1 (first), step 3 (the first drop, by step 2, noted), not step 4 (one more drop), the end
    assert [b["status"]["step"] for b in sender.bodies] == [1, 3, 4]
    assert sender.bodies[1]["status"]["tracking"] == {"dropped": 1}
    assert sender.bodies[2]["status"]["tracking"] == {"dropped": 2}


def test_export_track_to_wandb_offline_logs_a_model_artifact_to_the_runs_own_wandb_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from kiln.api import TrainingSpec
    from kiln.trainer.observe.tracking import WandbTracker, log_export

    store = FileStore(tmp_path / "checkpoints")
    tracking = Tracking([WandbTracker("kiln-test", None, "offline", "t", str(tmp_path))], params={}, store=store)
    tracking.offer({"step": 1, "loss": 1.0})
    tracking.close(timeout=600)  # returns once W&B finished: the bound is for a client that never does
    assert tracking.errors == {}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model" / "stray.txt").write_text("not the export's")
    doc = TrainingSpec.model_validate({"metadata": {"name": "t"}, "spec": {
        "tracking": {"wandb": {"project": "kiln-test", "mode": "offline"}}}})
    said = log_export(doc, store=store, folder=tmp_path / "model", files=["config.json"], step=1, fmt="hf",
                      wandb_dir=str(tmp_path))
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len({p.stem for p in runs}) == 1 and said == [f"wandb run {runs[0].stem[4:]}: artifact t-model (type model)"]
    # W&B's offline transaction log (protobuf records) of the export's session holds the artifact and its one file
    log = runs[-1].read_bytes()
    assert b"t-model" in log and b"config.json" in log and b"stray.txt" not in log
    wandb_cli = Path(sys.executable).parent / "wandb"
    proc = subprocess.run([str(wandb_cli), "sync", "--dry-run", *map(str, {p.parent for p in runs})],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"Would sync {len(runs)} run(s)" in proc.stdout + proc.stderr, proc.stderr
