"""Predictive failover from GPU health, the pure parts: the trainer's reading (through a FAKE pynvml at the
NVML boundary; kiln.trainer.observe.gpu_health's own code runs), what it reports (status, Prometheus), and the
operator's decision (kiln.control.failover) and its price in the goodput ledger."""

from __future__ import annotations

import json
import sys

import pytest
from prometheus_client import generate_latest

from kiln.api.spec import TrainingSpecStatus, TrainingSpecSpec
from kiln.control import elastic, failover
from kiln.control.elastic import NodeView
from kiln.control.goodput import Ledger, held, observe
from kiln.trainer.observe import gpu_health as health
from kiln.trainer.observe.exporter import TrainerExporter
from kiln.trainer.observe.metrics import MetricsLogger
from kiln.trainer.observe.status_report import StatusReporter

from tests.fake_nvml import pynvml as fake_pynvml


# ---- the trainer's reading --------------------------------------------------------------------------------


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """The FAKE pynvml in place of nvidia-ml-py; returns a function that writes the GPUs it shows."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)
    monkeypatch.setattr(fake_pynvml, "_delivered", {})
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML_STATE", str(path))

    def show(*gpus: dict, init_error: str | None = None) -> None:
        path.write_text(json.dumps({"gpus": list(gpus), "init_error": init_error}))
    show({"name": "FAKE-H200"}, {"name": "FAKE-H200"})
    return show


def test_each_gpu_gets_its_state_and_the_node_the_worst(nvml):
    monitor = health.GpuMonitor()
    ok = monitor.probe(expected=2)
    assert ok.state == "Healthy" and ok.gpus == {0: "Healthy", 1: "Healthy"}
    nvml({"name": "FAKE-H200", "temperature": 87, "slowdown": 90}, {"name": "FAKE-H200", "ecc_uncorrected": 2})
    bad = monitor.probe(expected=2)
    assert bad.gpus == {0: "Degrading", 1: "Failing"} and bad.state == "Failing"
    entry = bad.entry("node-a", step=40)
    assert entry["node"] == "node-a" and entry["step"] == 40 and entry["state"] == "Failing"
    assert "GPU 1 (FAKE-H200): 2 uncorrected ECC error(s)" in entry["message"] and "87°C" in entry["message"]
    TrainingSpecStatus.model_validate({"gpuHealth": [entry]})  # fits the CRD's schema


def test_an_xid_event_counts_once(nvml):
    nvml({"name": "FAKE-H200", "xids": [79]})
    monitor = health.GpuMonitor()
    first = monitor.probe(expected=1)
    assert first.state == "Failing" and "XID 79" in first.reasons[0]
    assert monitor.probe(expected=1).state == "Healthy"  # NVML delivers each event once


@pytest.mark.parametrize("expected,state", [(8, "Unknown"), (0, "NotApplicable")])
def test_unreadable_nvml_is_unknown_on_a_gpu_node_never_healthy(nvml, expected, state):
    nvml(init_error="Driver Not Loaded")
    report = health.GpuMonitor().probe(expected=expected)
    assert report.state == state and "Driver Not Loaded" in report.reasons[0]
    assert set(report.gpus.values()) <= {"Unknown"} and len(report.gpus) == expected


def test_without_nvidia_ml_py_a_cpu_process_is_not_applicable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as on a machine without the package
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    report = health.probe()
    assert report.state == "NotApplicable" and "nvidia-ml-py is not installed" in report.reasons[0]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-1,GPU-2")  # a GPU pod whose image lacks the package
    assert health.probe().state == "Unknown" and health.expected_gpus() == 2


def test_the_gauge_encodes_each_gpu_and_drops_a_node_the_run_left():
    exporter = TrainerExporter("r")
    a = {"node": "a", "state": "Failing", "gpus": [{"index": 0, "state": "Healthy"}, {"index": 1, "state": "Failing"}]}
    b = {"node": "b", "state": "Degrading", "gpus": [{"index": 0, "state": "Degrading"}]}
    u = {"node": "u", "state": "Unknown", "gpus": [{"index": 0, "state": "Unknown"}]}
    cpu = {"node": "c", "state": "NotApplicable", "gpus": []}
    exporter.observe({"gpu_health": [a, b, u, cpu]})
    text = generate_latest(exporter.registry).decode()
    for node, gpu, value in (("a", 0, 0.0), ("a", 1, 2.0), ("b", 0, 1.0), ("u", 0, -1.0)):
        assert f'kiln_gpu_health{{gpu="{gpu}",node="{node}",run="r"}} {value}' in text
    assert 'node="c"' not in text  # no GPU there: no series, not a healthy 0
    exporter.observe({"gpu_health": [b]})
    assert 'node="a"' not in generate_latest(exporter.registry).decode()
    # a reading at a step that is not logged still reaches the gauge (kiln.trainer.loop: logger.export)
    MetricsLogger(None, rank=0, total_steps=10, start_step=0, exporter=exporter).export({"step": 3, "gpu_health": [a]})
    assert 'kiln_gpu_health{gpu="1",node="a",run="r"} 2.0' in generate_latest(exporter.registry).decode()


def test_a_change_of_gpu_health_is_reported_at_once():
    class Sender:
        def __init__(self):
            self.bodies = []

        def submit(self, body):
            self.bodies.append(body)

    sender, t = Sender(), [0.0]
    rep = StatusReporter(100, sender=sender, every_s=1e9, clock=lambda: t[0])
    ok = [{"node": "a", "state": "Healthy", "gpus": [{"index": 0, "state": "Healthy"}], "step": 1}]
    bad = [{"node": "a", "state": "Failing", "gpus": [{"index": 0, "state": "Failing"}], "step": 3}]
    rep.update({"step": 1, "step_s": 1.0, "gpu_health": ok}, None)
    rep.update({"step": 2, "step_s": 1.0}, None)  # rate-limited: nothing new
    rep.update({"step": 3, "step_s": 1.0, "gpu_health": ok}, None)  # the same health again: nothing new
    rep.update({"step": 4, "step_s": 1.0, "gpu_health": bad}, None)
    assert [b["status"]["step"] for b in sender.bodies] == [1, 4]
    assert sender.bodies[-1]["status"]["gpuHealth"] == bad


# ---- the operator's decision ---------------------------------------------------------------------------------


SPEC = TrainingSpecSpec.model_validate({"resources": {"nodes": 1, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}})


def nodes(*names: str) -> list[NodeView]:
    return [NodeView(n, labels={elastic.GPU_PRODUCT_LABEL: "NVIDIA-H200"}, gpus_free=8) for n in names]


def entry(node: str, state: str, message: str = "") -> dict:
    return {"node": node, "state": state, "message": message, "gpus": [{"index": 3, "state": state}]}


def pod(node: str, deleting: bool = False) -> dict:
    meta = {"name": f"w-{node}", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "spec": {"nodeName": node}}


FAILING = entry("a", "Failing", "GPU 3 (H200): 2 uncorrected ECC error(s)")


def test_a_failing_gpu_moves_the_run_at_a_requested_commit_and_names_node_gpu_and_cause():
    s = failover.step(SPEC, {"step": 40, "gpuHealth": [FAILING]}, {}, [pod("a")], nodes("a", "b"))
    assert s.move == {"a": "Failing: GPU 3 (H200): 2 uncorrected ECC error(s)"}
    assert s.state["gpuAvoid"] == s.move and s.state["gpuFailover"] == {"nodes": s.move, "step": 40}
    (kind, reason, message), = s.events
    assert (kind, reason) == ("Warning", "GPUFailover")
    assert "moving off a" in message and "uncorrected ECC" in message and "commit is requested" in message
    assert s.condition[:2] == ("False", failover.MOVING) and "node a" in s.condition[2] and "step 40" in s.condition[2]


def test_the_move_lasts_until_the_trainer_reports_from_elsewhere():
    started = failover.step(SPEC, {"step": 40, "gpuHealth": [FAILING]}, {}, [pod("a")], nodes("a", "b")).state
    # the old trainer still reports from node a (its pod is terminating): still moving, nothing decided again
    s = failover.step(SPEC, {"step": 41, "gpuHealth": [FAILING]}, started, [pod("a", deleting=True)], nodes("a", "b"))
    assert not s.move and not s.events and s.condition[1] == failover.MOVING
    healthy_b = entry("b", "Healthy")
    done = failover.step(SPEC, {"step": 42, "gpuHealth": [healthy_b]}, started, [pod("b")], nodes("a", "b"))
    assert done.state == {"gpuFailover": None, "gpuMoved": started["gpuFailover"]}
    assert done.events == [("Normal", "GPUFailoverDone", "the run reports from b, off a (left at step 40)")]
    assert done.condition[:2] == ("True", "GPUsHealthy") and "moved off a at step 40" in done.condition[2]
    assert "uncorrected ECC" in done.condition[2]  # the condition keeps saying why


def test_a_degrading_gpu_moves_only_where_the_run_can_start_elsewhere():
    hot = entry("a", "Degrading", "GPU 3: 87°C, at or above 85°C (thermal slowdown near)")
    moves = failover.step(SPEC, {"step": 5, "gpuHealth": [hot]}, {}, [pod("a")], nodes("a", "b"))
    assert list(moves.move) == ["a"]
    stays = failover.step(SPEC, {"step": 5, "gpuHealth": [hot]}, {}, [pod("a")], nodes("a"))
    assert not stays.move and stays.events[0][1] == "GPUDegraded" and "only 0 other node(s)" in stays.events[0][2]
    assert stays.condition[:2] == ("False", "GPUDegrading")
    again = failover.step(SPEC, {"step": 6, "gpuHealth": [hot]}, {**stays.state}, [pod("a")], nodes("a"))
    assert not again.events  # said once
    # a failing one is left even so: it would fail the run; the pods wait for capacity
    failing = failover.step(SPEC, {"step": 5, "gpuHealth": [FAILING]}, {}, [pod("a")], nodes("a"))
    assert list(failing.move) == ["a"] and "wait for capacity" in failing.events[0][2]


def test_only_nodes_the_run_is_on_and_not_left_already_count():
    assert failover.bad_nodes([FAILING], running_on=["b"], avoided=[]) == {}
    assert failover.bad_nodes([FAILING], running_on=["a"], avoided=["a"]) == {}
    assert failover.bad_nodes([FAILING, entry("b", "Healthy")], ["a", "b"], []) == {"a": failover._why(FAILING)}


@pytest.mark.parametrize("reported,expected", [
    ([entry("a", "Healthy"), entry("b", "Healthy")], ("True", "GPUsHealthy")),
    ([entry("a", "Unknown", "GPU health unknown: NVML unavailable")], ("Unknown", "GPUHealthUnknown")),
    ([{"node": "a", "state": "NotApplicable", "message": "no GPU in use", "gpus": []}], ("Unknown", "NotApplicable")),
    ([entry("a", "Healthy"), entry("b", "Degrading")], ("False", "GPUDegrading")),
])
def test_the_condition_never_calls_unread_gpus_healthy(reported, expected):
    assert failover.condition(reported)[:2] == expected
    assert failover.condition([]) is None


def test_the_move_is_priced_as_gpu_failover_in_the_goodput_ledger():
    moving = {"phase": "Running", "conditions": [{"type": "GPUHealthy", "status": "False", "reason": failover.MOVING}]}
    assert held(moving) == failover.MOVING
    assert held({**moving, "phase": "Succeeded"}) == "Succeeded"
    zero = {"productiveSeconds": 0.0, "checkpointStallSeconds": 0.0, "rollbackSeconds": 0.0}
    ledger = observe(Ledger(observed_at=0.0), 30.0, held(moving), zero)
    assert ledger.lost_s["gpuFailover"] == 30.0 and ledger.wall_s == 30.0
    TrainingSpecStatus.model_validate(ledger.as_status())  # lostSeconds.gpuFailover is in the CRD


def test_a_pod_recreated_on_the_node_being_left_is_deleted_again():
    started = failover.step(SPEC, {"step": 40, "gpuHealth": [FAILING]}, {}, [pod("a")], nodes("a", "b")).state
    s = failover.step(SPEC, {"step": 41, "gpuHealth": [FAILING]}, started, [pod("a", deleting=True), pod("a")],
                      nodes("a", "b"))
    assert s.strays == ["w-a"] and not s.move
