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


def _gpu_spec(nodes: int, **elastic):
    from kiln.api.spec import TrainingSpecSpec

    return TrainingSpecSpec.model_validate({"resources": {"nodes": nodes, "gpusPerNode": 2, "gpuType": "NVIDIA-H200"},
                                            "elastic": elastic})


def test_a_preflight_slow_node_fails_the_run_only_where_its_elastic_bounds_cannot_do_without_it():
    from kiln.trainer.observe.preflight import cannot_leave

    nodes, rates = ["a", "a", "b", "b"], [100.0, 100.0, 100.0, 20.0]  # 2 pods x 2 ranks: rank 3's GPU is slow
    median, slow = judge(rates, nodes, 0.8)
    result = {"gflops": rates, "nodes": nodes, "slow": slow, "min_relative_speed": 0.8}
    why = cannot_leave(result, _gpu_spec(2))  # 2 nodes, no elastic bounds: it cannot start on node a alone
    assert why.startswith("resources.preflight: rank 3 on node b at 0.2 of the others' median")
    assert "without node(s) b, 1 of the run's 2 node(s) remain and it needs at least 2" in why
    assert "elastic.minNodes" in why and "resources.preflight.enabled false" in why  # the two fixes
    assert cannot_leave(result, _gpu_spec(2, minNodes=1)) is None  # it can: the operator moves it off b
    assert cannot_leave({**result, "slow": []}, _gpu_spec(2)) is None
    # both pods on one (slow) machine: nothing is left without it, whatever the bounds
    same = {**result, "nodes": ["a"] * 4, "slow": judge(rates, ["a"] * 4, 0.8)[1]}
    assert "0 of the run's 2 node(s) remain and it needs at least 1" in cannot_leave(same, _gpu_spec(2, minNodes=1))


def _straggler_tick(nodes: str, state: dict | None = None):
    from kiln.control import elastic, failover

    spec = _gpu_spec(2, minNodes=2)
    views = [elastic.NodeView(n, labels={elastic.GPU_PRODUCT_LABEL: "NVIDIA-H200"}, gpus_free=2) for n in nodes]
    pods = [{"metadata": {"name": f"w-{n}"}, "spec": {"nodeName": n}} for n in "ab"]
    status = {"step": 40, "stragglers": [{"rank": 3, "node": "b", "relative": 2.4, "value": 0.6, "step": 40}]}
    return failover.step(spec, status, state or {}, pods, views)


def test_the_operator_replaces_a_stragglers_node_at_a_commit_where_the_run_can_start_without_it():
    moves = _straggler_tick("abc")  # node c is free: the run keeps its 2 nodes without b
    assert moves.move == {"b": "Degrading: straggler: rank 3's own step time at 2.4x the other ranks' median "
                                "(named at step 40)"}
    assert moves.state["gpuAvoid"] == moves.move and moves.state["gpuFailover"]["step"] == 40  # new pods avoid b
    assert moves.events[0][:2] == ("Warning", "GPUFailover") and "a commit is requested" in moves.events[0][2]
    assert moves.condition[:2] == ("False", "MovingOffNode")  # priced as gpuFailover by the ledger


def test_a_straggler_the_run_cannot_leave_trains_on_and_the_condition_says_why():
    stays = _straggler_tick("ab")  # minNodes 2 and no other node: it cannot start without b
    assert not stays.move and "gpuAvoid" not in stays.state
    assert stays.events == [("Warning", "GPUDegraded", stays.state["gpuStaying"])]  # once
    status, reason, message = stays.condition
    assert (status, reason) == ("False", "GPUDegrading")
    assert "node b: Degrading: straggler: rank 3" in message
    assert message.endswith("the run trains on there: only 1 other node(s) could host a worker, the run needs 2")
    again = _straggler_tick("ab", stays.state)  # the next tick: no second Event, the condition still says why
    assert again.events == [] and again.condition == stays.condition
