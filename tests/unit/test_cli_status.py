"""`kiln status` output without a cluster: the table's values are complete, the data forms are the objects.

The same output through a real pipe from a real apiserver: tests/integration/test_cli_status.py."""

from __future__ import annotations

import io
import re

from rich.console import Console

from kiln.cli import cluster_cmds
from kiln.cli.main import build_parser
from kiln.cli.cluster_cmds import (_print_table, as_data, condition_table, plain_table, queue_table, status_table,
                                   tracking_line)

LONG = "llama-8b-pretrain-with-a-very-long-experiment-name-that-goes-on-0123456789"


def _item(name: str, namespace: str = "team-with-a-long-namespace-name", **status) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
            "metadata": {"name": name, "namespace": namespace, "generation": 2,
                         "creationTimestamp": "2026-01-01T00:00:00Z", "managedFields": [{"manager": "kubectl"}]},
            "spec": {"training": {"steps": 1000}}, "status": status}


STATUS = {"phase": "Running", "nodes": 2, "step": 120, "progress": "12.0%", "tokensPerSecond": 123456.0, "mfu": 0.4123,
          "lastCheckpoint": {"step": 100, "uri": "s3://bucket/" + "x" * 80 + "/step-00000100/"}, "restarts": 1,
          "etaSeconds": 3700, "goodput": 0.95, "observedGeneration": 2,
          "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning", "message": "m" * 150}]}


def test_plain_table_keeps_every_value_whole_and_aligns_columns():
    header, rows = status_table([_item(LONG, **STATUS), _item("short")], all_namespaces=True)
    text = plain_table(header, rows)
    lines = text.splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "PHASE", "NODES", "STEP", "PROGRESS", "TOKENS/S", "MFU", "LAST",
                                "CHECKPOINT", "RESTARTS", "AGE"]
    assert LONG in lines[1] and "team-with-a-long-namespace-name" in lines[1] and "…" not in text
    assert lines[1].split()[2:10] == ["Running", "2", "120", "12.0%", "1.23e+05", "41.2%", "step", "100"]
    assert lines[2].split()[1:3] == ["short", "Pending"]  # no status yet
    assert lines[1].index("Running") == lines[2].index("Pending")  # columns line up past the long name
    assert all(line == line.rstrip() for line in lines)


def test_a_terminal_narrower_than_the_table_gets_whole_values_too():
    out = io.StringIO()
    header, rows = status_table([_item(LONG, **STATUS)], all_namespaces=True)
    _print_table(Console(file=out, force_terminal=True, width=60, color_system=None), header, rows, phase_column=2)
    text = out.getvalue()
    assert LONG in text and "team-with-a-long-namespace-name" in text and "…" not in text
    assert text.splitlines()[1].split()[:3] == ["team-with-a-long-namespace-name", LONG, "Running"]


def test_wide_adds_eta_goodput_cost_checkpoint_uri_and_generation():
    header, rows = status_table([_item(LONG, **STATUS)], all_namespaces=False, wide=True)
    assert header[-7:] == ["ETA", "GOODPUT", "GPU-HOURS", "COST", "CHECKPOINT URI", "GENERATION", "MESSAGE"]
    assert rows[0][0] == LONG and rows[0][-7:] == ["1h", "95.0%", "", "", STATUS["lastCheckpoint"]["uri"], "2/2", ""]
    cost = {"gpuHours": 16.0, "gpuHoursByCause": {"productive": 12.0, "restart": 4.0},
            "pricePerGpuHour": 3.5, "currency": "USD", "amount": 56.0}
    _, rows = status_table([_item(LONG, **STATUS, cost=cost)], all_namespaces=False, wide=True)
    assert rows[0][-5:-3] == ["16 (75% productive)", "56.00 USD"]


NO_EPHEMERAL = ("couldn't assign flavors to pod set worker: resource ephemeral-storage unavailable in ClusterQueue")


def test_a_queued_run_says_why_it_waits_in_wide_and_below_the_list(capsys, monkeypatch):
    queued = _item("q", phase="Queued", conditions=[
        {"type": "SpecAccepted", "status": "True", "reason": "Applied", "message": "ok"},
        {"type": "Queued", "status": "True", "reason": "Pending", "message": NO_EPHEMERAL}])
    admitted = _item("a", phase="Running", conditions=[
        {"type": "Queued", "status": "False", "reason": "Admitted", "message": "admitted by ClusterQueue gpus"}])
    refused = _item("r", phase="Pending", conditions=[
        {"type": "SpecAccepted", "status": "False", "reason": "NotCoveredByQueue", "message": "spec.resources.cpu: x"}])
    header, rows = status_table([queued, admitted, refused], all_namespaces=False, wide=True)
    assert [r[-1] for r in rows] == [f"Queued Pending: {NO_EPHEMERAL}", "",
                                     "SpecAccepted NotCoveredByQueue: spec.resources.cpu: x"]

    class FakeKube:  # stands in for the apiserver: the listing only
        def trainingspecs(self, namespace):
            return [queued, admitted, refused]

    monkeypatch.setattr(cluster_cmds, "_kube", lambda args: FakeKube())
    args = build_parser().parse_args(["status", "-n", "ml"])
    assert cluster_cmds.status(args) == 0
    out = capsys.readouterr().out
    assert f"q: Queued Pending: {NO_EPHEMERAL}" in out and "r: SpecAccepted NotCoveredByQueue" in out
    assert "a: " not in out


def test_conditions_keep_their_whole_message():
    header, rows = condition_table(_item("r", **STATUS))
    assert rows == [["Running", "True", "PodsRunning", "m" * 150]]
    assert ("m" * 150) in plain_table(header, rows)


def test_data_is_the_objects_without_managed_fields():
    one = as_data([_item(LONG, **STATUS)], name=LONG)
    assert one["status"] == STATUS and one["metadata"]["name"] == LONG and "managedFields" not in one["metadata"]
    many = as_data([_item("a"), _item("b")], name=None)
    assert many["kind"] == "List" and [i["metadata"]["name"] for i in many["items"]] == ["a", "b"]


def test_one_queued_run_shows_its_queue_and_once_admitted_where_kueue_placed_it():
    assert queue_table(_item("plain", **STATUS)) is None  # no scheduling.queue: no table
    waiting = plain_table(*queue_table(_item("q", queue={"name": "team-a"})))
    assert waiting.splitlines()[1].split() == ["team-a", "not", "yet"]
    admitted = {"name": "team-a", "admittedAt": "2026-01-01T00:01:00Z", "clusterQueue": "gpus",
                "flavors": ["h200-racks"], "topology": {"levels": ["kubernetes.io/hostname"],
                                                        "domains": ["node-b0-r0-h0", "node-b0-r0-h1"]}}
    row = plain_table(*queue_table(_item("q", queue=admitted))).splitlines()[1]
    assert re.split(r"\s{3,}", row)[:4] == ["team-a", "gpus", "h200-racks", "2026-01-01T00:01:00Z"]
    assert row.endswith("kubernetes.io/hostname: node-b0-r0-h0, node-b0-r0-h1")


def test_one_run_says_when_its_tracker_failed_or_dropped_records():
    assert tracking_line(_item("well", **STATUS)) is None  # absent while every record reaches the tracker
    failing = _item("t", **STATUS, tracking={"dropped": 3, "error": "mlflow: connection refused"})
    assert tracking_line(failing) == "tracking: 3 record(s) dropped; mlflow: connection refused"
