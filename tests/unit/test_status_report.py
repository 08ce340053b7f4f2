"""What trainer rank 0 writes into TrainingSpec/status: the patch body, when it is sent, the time
counters the operator's goodput is made of, failures."""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from kiln.api.spec import TrainingSpecStatus
from kiln.trainer.observe import status_report
from kiln.trainer.observe.status_report import StatusReporter, StatusSender, status_patch
from tests.support.ranks import SAFETY_TIMEOUT_S, wait_until
from tests.support.status import Clock, FakeSender, record

STATUS_FIELDS = {f.alias for f in TrainingSpecStatus.model_fields.values()}
OPERATOR_FIELDS = {"phase", "nodes", "conditions", "restarts", "observedGeneration", "goodput", "goodputDetail"}
COMMITTED = {"lastCheckpoint": {"step": 100, "uri": "s3://ckpt/run/step-00000100/", "time": 1_795_000_000.5}}


def test_patch_body_carries_the_trainer_fields_under_their_wire_names():
    body = status_patch(record(123), COMMITTED, 1000, seconds_per_step=2.0,
                        trainer_time={"productive_s": 90.0, "checkpoint_stall_s": 4.5, "rollback_s": 2.0})
    status = body["status"]
    assert status == {"step": 123, "progress": "12.3%", "etaSeconds": 1754, "tokensPerSecond": 4096.0,
                      "mfu": 0.41, "lastCheckpoint": {"step": 100, "uri": "s3://ckpt/run/step-00000100/",
                                                      "time": "2026-11-18T11:06:40Z"},
                      "trainerTime": {"productiveSeconds": 90.0, "checkpointStallSeconds": 4.5,
                                      "rollbackSeconds": 2.0}}
    assert set(status) <= STATUS_FIELDS and not set(status) & OPERATOR_FIELDS
    parsed = TrainingSpecStatus.model_validate(status)  # the same values the API model accepts
    assert (parsed.step, parsed.last_checkpoint.step, parsed.eta_seconds) == (123, 100, 1754)
    assert parsed.trainer_time.checkpoint_stall_seconds == 4.5


def test_patch_body_before_the_first_commit_and_at_the_end():
    first = status_patch(record(1), {}, 400)["status"]
    assert first["progress"] == "0.2%" and "lastCheckpoint" not in first and "etaSeconds" not in first
    last = status_patch(record(400), COMMITTED, 400, seconds_per_step=3.0)["status"]
    assert (last["progress"], last["etaSeconds"]) == ("100.0%", 0)


def test_patch_body_after_a_rollback_reports_the_step_resumed_from():
    assert status_patch(record(57, rolled_back_to=50), COMMITTED, 100)["status"]["step"] == 50


def test_patch_body_keeps_values_inside_the_crd_bounds():
    status = status_patch(record(5, mfu=float("nan")), None, 10, seconds_per_step=float("inf"),
                          trainer_time={"productive_s": -0.0, "checkpoint_stall_s": 0.0, "rollback_s": 0.0})["status"]
    assert "mfu" not in status and "etaSeconds" not in status  # NaN/inf are not JSON, the apiserver refuses them
    TrainingSpecStatus.model_validate(status)


def test_reports_are_rate_limited_but_every_commit_and_the_end_go_out():
    clock, sender = Clock(), FakeSender()
    rep = StatusReporter(10, sender=sender, every_s=10.0, clock=clock)
    for step in range(1, 11):
        clock.t += 2.0
        rep.update(record(step, step_s=1.5), COMMITTED if step >= 6 else {})
    rep.close({"lastCheckpoint": {"step": 10, "uri": "file:///c/step-00000010/", "time": None}})
    # step 1 (first), step 6 (new commit), step 7 isn't 10 s after 6, step 11 would be: only the end follows
    assert [b["status"]["step"] for b in sender.bodies] == [1, 6, 10]
    assert sender.bodies[1]["status"]["lastCheckpoint"]["step"] == 100
    final = sender.bodies[-1]["status"]
    assert final["lastCheckpoint"] == {"step": 10, "uri": "file:///c/step-00000010/"}
    assert final["etaSeconds"] == 0 and final["trainerTime"]["productiveSeconds"] == pytest.approx(15.0)
    assert "goodput" not in final  # the operator's field: it also sees the time no trainer runs
    assert sender.closed


def test_time_counters_count_redone_steps_as_rollback_and_continue_after_a_restart():
    clock = Clock()
    rep = StatusReporter(100, clock=clock)
    for step in (1, 2, 3):
        clock.t += 1.0
        rep.update(record(step, step_s=0.5), None)
    clock.t += 1.0
    rep.update(record(4, step_s=0.5, rolled_back_to=2), None)  # a guard rolled back: step 4 was not progress
    for step in (3, 4):
        clock.t += 1.0
        rep.update(record(step, step_s=0.5), None)  # step 3 again: not new progress either
    rep.stalled(0.25)
    rep.stalled(float("nan"))  # a broken measurement adds nothing
    saved = rep.state_dict()
    assert saved == {"productive_s": 2.0, "checkpoint_stall_s": 0.25, "rollback_s": 1.0, "preflight_s": 0.0}
    # a new process resumes from a checkpoint holding that account and counts on from it
    again = StatusReporter(100, clock=clock, restored={"step": 4, "goodput": saved})
    clock.t += 1.0
    again.update(record(5, step_s=1.0), None)
    assert again.state_dict() == {"productive_s": 3.0, "checkpoint_stall_s": 0.25, "rollback_s": 1.0,
                                  "preflight_s": 0.0}


def test_without_the_pod_environment_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("KILN_RUN_NAME", raising=False)
    monkeypatch.setenv("KILN_NAMESPACE", "ml")
    rep = StatusReporter.from_env(10, rank=0)
    rep.update(record(1), None)
    rep.close()
    assert not [t for t in threading.enumerate() if t.name == "kiln-status"]
    monkeypatch.setenv("KILN_RUN_NAME", "r")
    assert StatusReporter.from_env(10, rank=1)._sender is None  # only rank 0 reports


def write_kubeconfig(path, server: str) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


class HeldApiserver(ThreadingHTTPServer):
    """A real HTTP server on loopback that answers status patches, holding the first one until the test
    releases it (an apiserver that is slow to answer)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.first_arrived, self.release = threading.Event(), threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append({"path": self.path, "body": body})
                if len(server.bodies) == 1:
                    server.first_arrived.set()
                    server.release.wait(SAFETY_TIMEOUT_S)
                reply = json.dumps({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_submit_returns_while_the_apiserver_holds_the_request(tmp_path, monkeypatch, caplog):
    """The training thread only hands a body over: submit returns while the sender's patch is still held by
    the apiserver (no clock: the server answers only after the test has got past the submits)."""
    server = HeldApiserver()
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{server.server_port}"))
    # the client's own timeout would turn a submit that waits for the answer into a warning, not a hang;
    # made long so that a loaded machine holding the request for a while is no failure either
    monkeypatch.setattr(status_report, "REQUEST_TIMEOUT_S", SAFETY_TIMEOUT_S)
    caplog.set_level(logging.WARNING, logger="kiln.status")
    sender = StatusSender("run", "ml")
    try:
        sender.submit({"status": {"step": 1}})
        wait_until("the first patch at the apiserver", server.first_arrived.is_set)
        sender.submit({"status": {"step": 2}})  # the sender is inside its HTTP call: these only queue
        sender.submit({"status": {"step": 3}})
        assert not server.release.is_set() and len(server.bodies) == 1
    finally:
        server.release.set()
    wait_until("the newest body at the apiserver", lambda: len(server.bodies) == 2)
    sender.close(timeout=SAFETY_TIMEOUT_S)
    server.shutdown()
    assert not sender._thread.is_alive()
    path = "/apis/kiln.dev/v1alpha1/namespaces/ml/trainingspecs/run/status"
    # step 2 was replaced by step 3 before the sender was free: only the newest body goes out
    assert server.bodies == [{"path": path, "body": {"status": {"step": 1}}},
                             {"path": path, "body": {"status": {"step": 3}}}]
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no timeout, no failure


def test_an_unreachable_apiserver_is_one_warning(tmp_path, monkeypatch, caplog):
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "kubeconfig", f"https://127.0.0.1:{port}"))
    caplog.set_level(logging.WARNING, logger="kiln.status")
    sender = StatusSender("run", "ml")
    sender.submit({"status": {"step": 1}})
    wait_until("the sender's warning", lambda: caplog.records)
    sender.submit({"status": {"step": 2}})
    sender.close(timeout=SAFETY_TIMEOUT_S)
    assert not sender._thread.is_alive()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert f"127.0.0.1:{port}" in warnings[0] and "ml/run" in warnings[0] and "training goes on" in warnings[0]
    assert "refused" in warnings[0].lower(), warnings[0]


def test_missing_credentials_are_named_in_the_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    caplog.set_level(logging.WARNING, logger="kiln.status")
    sender = StatusSender("run", "ml")
    sender.submit({"status": {"step": 1}})
    sender.close()
    [warning] = [r.getMessage() for r in caplog.records]
    assert "no Kubernetes credentials" in warning and "KUBECONFIG" in warning
