"""The pure rules that name a slow rank: the pre-flight check's (kiln.trainer.observe.preflight) and the
straggler watch's (kiln.trainer.observe.stragglers); how the trainer reports them (status, Prometheus) and how
the goodput ledger prices the check (kiln.control.goodput)."""

from __future__ import annotations

from kiln.api.spec import TrainingSpecStatus
from kiln.control.goodput import Ledger, counters, observe
from kiln.trainer.observe.exporter import TrainerExporter
from kiln.trainer.observe.preflight import judge, status_entry
from kiln.trainer.observe.status_report import StatusReporter, status_patch
from kiln.trainer.observe.stragglers import Streaks, slow_ranks


def test_preflight_names_a_rank_below_the_threshold_of_the_other_ranks_median():
    median, slow = judge([100.0, 98.0, 60.0, 101.0], ["a", "a", "b", "c"], 0.8)
    assert median == 99.0
    assert slow == [{"rank": 2, "node": "b", "relative": 0.6, "value": 60.0}]
    # two ranks: the other's rate is the yardstick, so 0.7 of it is slow (the median of both would say 0.82)
    assert [s["rank"] for s in judge([100.0, 70.0], ["a", "b"], 0.8)[1]] == [1]
    assert judge([100.0, 85.0], ["a", "b"], 0.8)[1] == []
    assert judge([50.0], ["a"], 0.8)[1] == []  # a world of one has no yardstick


def test_a_rank_is_a_straggler_only_after_window_consecutive_slow_reports():
    assert slow_ranks([0.1, 0.1, 0.2, 0.11], 1.5) == {2: 2.0}
    streaks = Streaks(factor=1.5, window=3)
    assert streaks.report([0.1, 0.2]) == {}
    assert streaks.report([0.1, 0.2]) == {}
    assert streaks.report([0.1, 0.2]) == {1: 2.0}
    assert streaks.report([0.1, 0.12]) == {}  # one report not slow: no longer named, the streak starts again
    assert streaks.report([0.1, 0.2]) == {}


def test_the_trainer_reports_both_in_status_and_the_check_in_trainer_time():
    result = {"seconds": 0.4, "gflops": [30.0, 6.0], "nodes": ["a", "b"], "median_gflops": 18.0,
              "bandwidth_gbps": 1.5, "min_relative_speed": 0.8,
              "slow": [{"rank": 1, "node": "b", "relative": 0.2, "value": 6.0}]}
    reporter = StatusReporter(10)
    reporter.preflight(result, step=0)
    assert reporter.state_dict()["preflight_s"] == 0.4  # carried in the checkpoint, counted from the run's start
    stragglers = [{"rank": 1, "node": "b", "relative": 2.0, "value": 0.2, "step": 6}]
    patch = status_patch({"step": 6}, None, 10, trainer_time=reporter.state_dict(),
                         preflight=status_entry(result, step=0, checked_at="2026-01-01T00:00:00Z"),
                         stragglers=stragglers)
    status = TrainingSpecStatus.model_validate(patch["status"])  # the CRD's model takes it
    assert status.preflight.slow[0].node == "b" and status.stragglers[0].rank == 1
    assert patch["status"]["trainerTime"]["preflightSeconds"] == 0.4


def test_the_ledger_prices_the_check_as_preflight():
    ledger = Ledger(observed_at=0.0)
    ledger = observe(ledger, 100.0, "Running", counters({"trainerTime": {"preflightSeconds": 3.0,
                                                                         "productiveSeconds": 90.0}}), gpus=8)
    assert ledger.lost_s["preflight"] == 3.0 and ledger.productive_s == 90.0
    assert ledger.gpu_s["preflight"] == 24.0
    assert TrainingSpecStatus.model_validate(ledger.as_status()).goodput_detail.lost_seconds.preflight == 3.0


def test_the_exporter_shows_each_ranks_split_and_a_series_per_straggler_until_it_is_not_one():
    exporter = TrainerExporter("r")
    record = {"rank_own_s": [0.1, 0.3], "rank_wait_s": [0.2, 0.0], "rank_nodes": ["a", "b"],
              "stragglers": [{"rank": 1, "node": "b", "relative": 3.0, "value": 0.3, "step": 6}]}
    exporter.observe(record)
    get = exporter.registry.get_sample_value
    assert get("kiln_train_straggler", {"run": "r", "rank": "1", "node": "b"}) == 1
    assert get("kiln_train_rank_own_seconds", {"run": "r", "rank": "1", "node": "b"}) == 0.3
    assert get("kiln_train_rank_wait_seconds", {"run": "r", "rank": "0", "node": "a"}) == 0.2
    exporter.observe({**record, "stragglers": []})
    assert get("kiln_train_straggler", {"run": "r", "rank": "1", "node": "b"}) is None


def test_the_operator_moves_a_run_off_a_node_the_preflight_check_named_only_where_it_can_start_elsewhere():
    from kiln.api.spec import TrainingSpecSpec
    from kiln.control import elastic, failover

    spec = TrainingSpecSpec.model_validate({"resources": {"nodes": 1, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}})
    views = [elastic.NodeView(n, labels={elastic.GPU_PRODUCT_LABEL: "NVIDIA-H200"}, gpus_free=8) for n in "ab"]
    pods = [{"metadata": {"name": "w-a"}, "spec": {"nodeName": "a"}}]
    status = {"step": 0, "preflight": {"slow": [{"rank": 3, "node": "a", "relative": 0.41, "value": 200.0},
                                                {"rank": 5, "node": "a", "relative": 0.6, "value": 300.0}]}}
    moves = failover.step(spec, status, {}, pods, views)
    assert moves.move == {"a": "Degrading: pre-flight: rank 3's matmul at 0.41 of the other ranks' median"}
    assert moves.state["gpuAvoid"] == moves.move and moves.events[0][1] == "GPUFailover"  # new pods avoid it
    stays = failover.step(spec, status, {}, pods, views[:1])  # nowhere else to start: stays, says why once
    assert not stays.move and stays.events[0][1] == "GPUDegraded" and "pre-flight" in stays.events[0][2]
    assert failover.step(spec, {"step": 0, "preflight": {"slow": []}}, {}, pods, views).move == {}
