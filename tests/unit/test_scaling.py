"""Scaling efficiency per phase (kiln.control.scaling, status.scaling): each node count's tokens/s per worker
against the first node count's, from the trainer's own reports."""

from __future__ import annotations

import pytest

from kiln.api.spec import TrainingSpecStatus
from kiln.control.scaling import fold, workers_per_node


def reports(record, nodes: int, per_node: int, steps_and_rates):
    for step, rate in steps_and_rates:
        record = fold(record, nodes=nodes, per_node=per_node, step=step, tokens_per_second=rate)
    return record


def test_a_plan_from_one_node_to_two_reports_the_second_phase_from_its_own_throughput():
    record = reports(None, 1, 8, [(10, 500.0), (20, 8000.0), (30, 8000.0)])  # step 10: start-up, skipped
    # two nodes at 0.9 of perfect scaling: 2 x 8000 x 0.9 tokens/s
    record = reports(record, 2, 8, [(40, 900.0), (50, 14400.0), (60, 14400.0)])
    first, second = record["phases"]
    assert (first["nodes"], first["workers"], first["tokensPerSecondPerWorker"], first["efficiency"]) == \
        (1, 8, 1000.0, 1.0)
    assert (second["nodes"], second["workers"], second["tokensPerSecondPerWorker"], second["reports"]) == \
        (2, 16, 900.0, 2)
    assert second["efficiency"] == 0.9
    assert record["referenceNodes"] == 1
    TrainingSpecStatus.model_validate({"scaling": record})  # the CRD's status schema keeps what is written


def test_a_report_is_folded_once_and_the_average_follows_new_ones():
    record = reports(None, 1, 1, [(1, 100.0), (2, 100.0)])
    again = fold(record, nodes=1, per_node=1, step=2, tokens_per_second=100.0)  # a refresh for another reason
    assert again == record
    moved = fold(record, nodes=1, per_node=1, step=3, tokens_per_second=200.0)
    assert moved["phases"][0]["tokensPerSecondPerWorker"] == pytest.approx(0.2 * 200 + 0.8 * 100)
    assert moved["phases"][0]["reports"] == 2


def test_no_report_no_record():
    assert fold(None, nodes=2, per_node=8, step=None, tokens_per_second=None) is None
    assert fold(None, nodes=None, per_node=8, step=3, tokens_per_second=1.0) is None


def test_workers_per_node_counts_processes_gpus_or_one():
    assert workers_per_node({"processesPerNode": 2, "gpusPerNode": 8}) == 2
    assert workers_per_node({"gpusPerNode": 8}) == 8
    assert workers_per_node({}) == 1


def test_the_operator_folds_the_trainers_report_into_status():
    from kiln.control.status import derive

    ts = {"metadata": {"name": "r", "namespace": "ml", "creationTimestamp": "2026-01-01T00:00:00Z"},
          "spec": {"resources": {"nodes": 2, "processesPerNode": 2}},
          "status": {"phase": "Running", "nodes": 2, "step": 40, "tokensPerSecond": 4000.0,
                     "scaling": {"lastStep": 30, "lastNodes": 2, "referenceNodes": 2,
                                 "phases": [{"nodes": 2, "workers": 4, "tokensPerSecondPerWorker": 1000.0,
                                             "reports": 3, "efficiency": 1.0}]}}}
    status = derive(ts, None, [], "2026-01-01T00:10:00Z").status
    assert status["scaling"]["lastStep"] == 40 and status["scaling"]["phases"][0]["reports"] == 4
