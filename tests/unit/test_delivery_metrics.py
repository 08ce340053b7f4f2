"""Prometheus metrics of the operator and the trainer, and the Grafana dashboard that shows them."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.control import metrics as op
from kiln.trainer.observe.exporter import TrainerExporter
from tests.support.metrics import exported_names

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kiln" / "dashboards" / "kiln.json"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics and parse it as Prometheus would: {(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(name: str, **labels) -> float | None:
    return op.REGISTRY.get_sample_value(name, labels)


def test_reconcile_counts_outcomes_and_error_types():
    before_ok = value("kiln_operator_reconciles_total", handler="t-create", outcome="ok") or 0
    with op.reconcile("t-create"):
        pass
    with pytest.raises(KeyError):
        with op.reconcile("t-create"):
            raise KeyError("missing")
    assert value("kiln_operator_reconciles_total", handler="t-create", outcome="ok") == before_ok + 1
    assert value("kiln_operator_reconciles_total", handler="t-create", outcome="error") == 1
    assert value("kiln_operator_reconcile_errors_total", handler="t-create", error="KeyError") == 1
    assert value("kiln_operator_reconcile_duration_seconds_count", handler="t-create") == before_ok + 2


def test_a_reconcile_that_must_wait_is_a_retry_not_an_error():
    class Wait(Exception):
        pass

    with pytest.raises(Wait):
        with op.reconcile("t-wait", retry=(Wait,)):
            raise Wait("the Secret does not exist yet")
    assert value("kiln_operator_reconciles_total", handler="t-wait", outcome="retry") == 1
    assert value("kiln_operator_reconciles_total", handler="t-wait", outcome="error") is None
    assert value("kiln_operator_reconcile_errors_total", handler="t-wait", error="Wait") is None


def test_trainingspecs_by_phase_follow_updates_and_deletes():
    op.observe_status("t-ns", "a", {"phase": "Pending"})
    op.observe_status("t-ns", "b", {"phase": "Running"})
    op.observe_status("t-ns", "a", {"phase": "Running"})  # a phase change moves the run, it does not add one
    assert value("kiln_operator_trainingspecs", namespace="t-ns", phase="Running") == 2
    assert value("kiln_operator_trainingspecs", namespace="t-ns", phase="Pending") == 0
    op.observe_status("t-ns", "b", {"phase": "Failed"})
    op.forget("t-ns", "a")
    assert value("kiln_operator_trainingspecs", namespace="t-ns", phase="Running") == 0
    assert value("kiln_operator_trainingspecs", namespace="t-ns", phase="Failed") == 1
    op.forget("t-ns", "b")
    assert value("kiln_operator_trainingspecs", namespace="t-ns", phase="Failed") is None


def test_each_runs_goodput_and_restarts_come_from_its_status_which_the_operator_writes():
    op.observe_status("t-run", "a", {"phase": "Running", "goodput": 0.75, "restarts": 2})
    op.observe_status("t-run", "b", {"phase": "Pending"})  # nothing accounted yet: no series, not a made-up 0
    assert value("kiln_operator_run_goodput", namespace="t-run", run="a") == 0.75
    assert value("kiln_operator_run_restarts", namespace="t-run", run="a") == 2
    assert value("kiln_operator_run_goodput", namespace="t-run", run="b") is None
    op.observe_status("t-run", "a", {"phase": "Restarting", "goodput": 0.7, "restarts": 3})
    assert value("kiln_operator_run_restarts", namespace="t-run", run="a") == 3
    op.forget("t-run", "a")
    op.forget("t-run", "b")
    assert value("kiln_operator_run_goodput", namespace="t-run", run="a") is None


def test_each_runs_cost_by_cause_and_scaling_by_node_count_come_from_its_status():
    cost = {"gpuHours": 16.0, "gpuHoursByCause": {"productive": 12.0, "restart": 4.0},
            "amount": 56.0, "amountByCause": {"productive": 42.0, "restart": 14.0}, "currency": "USD"}
    op.observe_status("t-cost", "a", {"phase": "Running", "cost": cost})
    assert value("kiln_operator_run_gpu_hours", namespace="t-cost", run="a", cause="productive") == 12.0
    assert value("kiln_operator_run_gpu_hours", namespace="t-cost", run="a", cause="restart") == 4.0
    assert value("kiln_operator_run_cost", namespace="t-cost", run="a", cause="restart") == 14.0
    op.observe_status("t-cost", "a", {"phase": "Running", "scaling": {"phases": [
        {"nodes": 1, "efficiency": 1.0}, {"nodes": 4, "efficiency": 0.93}]}})
    assert value("kiln_operator_run_scaling_efficiency", namespace="t-cost", run="a", nodes="4") == 0.93
    op.forget("t-cost", "a")
    assert value("kiln_operator_run_gpu_hours", namespace="t-cost", run="a", cause="productive") is None


def test_operator_metrics_are_served_over_http():
    op.observe_status("t-http", "run", {"phase": "Succeeded"})
    server, _ = op.serve(0, addr="127.0.0.1")
    try:
        samples = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert samples[("kiln_operator_trainingspecs", (("namespace", "t-http"), ("phase", "Succeeded")))] == 1
    assert ("process_resident_memory_bytes", ()) in samples  # the pod's memory, for the dashboard and alerts
    op.forget("t-http", "run")


def test_trainer_exporter_serves_each_steps_metrics():
    exporter = TrainerExporter("run-1")
    port = exporter.start(0, addr="127.0.0.1")
    try:
        exporter.observe({"step": 10, "loss": 3.25, "tokens_per_second": 1.5e5, "mfu": 0.41, "step_s": 0.3,
                          "tokens_seen": 40960, "checkpoint_stall_s": 1.5})
        exporter.observe({"step": 11, "loss": 3.0, "step_s": 0.5, "checkpoint_stall_s": 0.5,
                          "note": "text is ignored", "guard_skipped": True})
        samples = scrape(port)
    finally:
        exporter.stop()
    run = (("run", "run-1"),)
    assert samples[("kiln_train_step", run)] == 11
    assert samples[("kiln_train_loss", run)] == 3.0
    assert samples[("kiln_train_mfu", run)] == pytest.approx(0.41)  # kept: the second record had none
    assert samples[("kiln_train_checkpoint_stall_seconds_total", run)] == pytest.approx(2.0)  # summed
    assert samples[("kiln_train_step_seconds_count", run)] == 2
    assert samples[("kiln_train_step_seconds_sum", run)] == pytest.approx(0.8)
    assert samples[("kiln_train_step_seconds_bucket", (("le", "0.5"),) + run)] == 2


def test_guard_counters_checkpoint_freshness_and_the_data_mix_are_exported():
    exporter = TrainerExporter("run-2")
    exporter.observe({"step": 40, "guard_rollbacks": 1, "guard_skipped_spike": 3, "guard_skipped_nonfinite": 0,
                      "steps_since_commit": 15, "checkpoint_interval_steps": 10,
                      "data_mix": {"s3://d/web/": 0.75, "s3://d/code/": 0.25}})
    value = exporter.registry.get_sample_value
    assert value("kiln_train_guard_rollbacks", {"run": "run-2"}) == 1
    assert value("kiln_train_guard_skipped_spike_steps", {"run": "run-2"}) == 3
    assert value("kiln_train_steps_since_commit", {"run": "run-2"}) == 15
    assert value("kiln_train_checkpoint_interval_steps", {"run": "run-2"}) == 10
    assert value("kiln_data_source_share", {"run": "run-2", "source": "s3://d/code/"}) == 0.25


def test_two_exporters_do_not_share_state_and_unreported_metrics_are_absent():
    a, b = TrainerExporter("a"), TrainerExporter("b")
    a.observe({"loss": 1.0})
    assert b.registry.get_sample_value("kiln_train_loss", {"run": "b"}) is None
    assert a.registry.get_sample_value("kiln_train_loss", {"run": "a"}) == 1.0
    # mfu was never reported: no series rather than a made-up 0 on the dashboard
    assert a.registry.get_sample_value("kiln_train_mfu", {"run": "a"}) is None


def test_dashboard_queries_only_metrics_that_exist_and_shows_all_of_kilns():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    queried = {m for e in exprs for m in re.findall(r"\bkiln_[a-z_]+", e)}
    names = exported_names()
    assert queried <= names, f"the dashboard queries metrics nobody exports: {sorted(queried - names)}"
    # `_created` is prometheus_client's creation timestamp of a counter/histogram: no panel needs it.
    families = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in names if n.startswith("kiln_")}
    shown = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in queried}
    assert families <= shown, f"metrics without a panel: {sorted(families - shown)}"


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for used in re.findall(r"\$(\w+)", target["expr"]):
                assert used in variables | {"__rate_interval"}, f"{panel['title']}: ${used} is not defined"


def test_a_mixture_of_experts_router_metrics_are_exported():
    """The RouterLoad's read (kiln.trainer.model.moe), as the loop puts it into the step's record, becomes gauges."""
    import torch

    from kiln.trainer.model.moe import RouterLoad, RouterStats

    load = RouterLoad(layers=2, experts=4)
    stats = [RouterStats(torch.tensor([6, 2, 0, 0]), torch.zeros(4), torch.zeros(()), 4),
             RouterStats(torch.tensor([2, 2, 2, 2]), torch.zeros(4), torch.zeros(()), 4)]
    load.add(stats, [0, 1])
    load.losses(torch.tensor(1.5), torch.tensor(0.25))
    record = load.read()
    assert record == pytest.approx({"moe_balance": 3.0, "moe_load_cv": (6 ** 0.5 / 2 + 0) / 2,  # std of 6,2,0,0: sqrt(6)
                                    "moe_busiest_tokens": 6, "moe_idlest_tokens": 0, "moe_aux_loss": 1.5,
                                    "moe_z_loss": 0.25})
    assert load.read() is None  # read once per step
    exporter = TrainerExporter("run-moe")
    exporter.observe({"step": 3, **record})
    value = lambda name: exporter.registry.get_sample_value(name, {"run": "run-moe"})  # noqa: E731
    assert value("kiln_train_moe_balance") == 3.0
    assert value("kiln_train_moe_busiest_expert_tokens") == 6 and value("kiln_train_moe_idlest_expert_tokens") == 0
    assert value("kiln_train_moe_aux_loss") == 1.5 and value("kiln_train_moe_z_loss") == 0.25
