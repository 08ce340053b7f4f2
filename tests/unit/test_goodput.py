"""The operator's goodput ledger: wall time since creation split into productive and lost by cause."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kiln.api.spec import TrainingSpecStatus
from kiln.control.goodput import CAUSES, PREEMPTED, Ledger, counters, held, observe, settled


def trainer(productive: float = 0.0, stall: float = 0.0, rollback: float = 0.0) -> dict:
    return {"productiveSeconds": productive, "checkpointStallSeconds": stall, "rollbackSeconds": rollback,
            "preflightSeconds": 0.0}


def test_a_run_split_by_phase_and_trainer_counters():
    g = Ledger(observed_at=1000.0)  # created
    g = observe(g, 1030.0, None, trainer())  # before the first status: pending
    g = observe(g, 1050.0, "Pending", trainer())
    g = observe(g, 1150.0, "Running", trainer(80.0, stall=5.0))  # 15 s start-up: wall only
    g = observe(g, 1170.0, "Restarting", trainer(80.0, stall=5.0))
    # the new trainer resumed from a commit holding 60 productive seconds: 20 s are done again
    g = observe(g, 1190.0, "Running", trainer(60.0, stall=5.0))
    g = observe(g, 1270.0, "Running", trainer(130.0, stall=5.0, rollback=10.0))
    g = observe(g, 1370.0, "Suspended", trainer(130.0, stall=5.0, rollback=10.0))
    assert g.wall_s == 370.0
    assert g.productive_s == pytest.approx(60.0 + 70.0)
    assert g.lost_s == {"pending": 50.0, "restart": 20.0 + 20.0, "checkpointStall": 5.0, "rollback": 10.0,
                        "suspended": 100.0, "preempted": 0.0, "gpuFailover": 0.0, "preflight": 0.0}
    assert g.goodput == pytest.approx(130.0 / 370.0)


def queued(reason: str) -> dict:
    return {"phase": "Queued", "conditions": [{"type": "Queued", "status": "True", "reason": reason}]}


def test_time_queued_after_kueue_preempted_the_run_counts_as_preempted_not_pending():
    assert held(queued("Preempted")) == PREEMPTED
    assert held(queued("Pending")) == "Queued"  # waiting for quota, not preempted
    assert held({"phase": "Running", "conditions": queued("Preempted")["conditions"]}) == "Running"
    assert held(None) is None
    g = observe(Ledger(observed_at=0.0), 100.0, "Running", trainer(90.0))
    g = observe(g, 160.0, held(queued("Preempted")), trainer(90.0))
    g = observe(g, 200.0, held(queued("Pending")), trainer(90.0))
    assert (g.lost_s["preempted"], g.lost_s["pending"], g.productive_s) == (60.0, 40.0, 90.0)
    status = g.as_status()
    assert TrainingSpecStatus.model_validate(status).goodput_detail.lost_seconds.preempted == 60.0
    assert Ledger.from_status(status, created=0.0) == g
    # a ledger written before the cause existed reads on, with nothing preempted yet
    del status["goodputDetail"]["lostSeconds"]["preempted"]
    assert Ledger.from_status(status, created=0.0).lost_s["preempted"] == 0.0


def test_counters_reported_late_are_credited_later_never_beyond_the_wall_time():
    g = observe(Ledger(observed_at=0.0), 10.0, "Running", trainer(25.0))  # only 10 s passed
    assert (g.productive_s, g.wall_s) == (10.0, 10.0)
    g = observe(g, 30.0, "Running", trainer(25.0))  # the other 15 s arrive with the next interval
    assert (g.productive_s, g.wall_s) == (25.0, 30.0)


def test_nothing_is_counted_after_the_run_ended_or_twice_for_the_same_time():
    g = observe(Ledger(observed_at=0.0), 100.0, "Running", trainer(90.0))
    assert observe(g, 5000.0, "Succeeded", trainer(90.0)) == g
    assert observe(g, 100.0, "Pending", trainer(90.0)) == g
    assert observe(g, 50.0, "Pending", trainer(90.0)) == g  # a stale clock does not take time back


def test_ledger_round_trips_through_status_and_fits_the_status_model():
    g = observe(observe(Ledger(observed_at=1_795_000_000.0), 1_795_000_100.0, "Pending", trainer()),
                1_795_000_160.0, "Running", trainer(40.0, stall=2.0))
    status = g.as_status()
    assert status["goodput"] == pytest.approx(40 / 160, abs=1e-4)
    assert status["goodputDetail"]["lostSeconds"]["pending"] == 100.0
    parsed = TrainingSpecStatus.model_validate(status)
    assert parsed.goodput_detail.lost_seconds.checkpoint_stall == 2.0
    assert Ledger.from_status(status, created=0.0) == g  # an operator restart continues the account
    assert Ledger.from_status({}, created=7.0) == Ledger(observed_at=7.0)


def test_trainer_counters_are_read_from_status_trainer_time():
    assert counters({"trainerTime": {"productiveSeconds": 3.5}}) == trainer(3.5)
    assert counters(None) == trainer()


@given(st.lists(st.tuples(st.floats(0, 500), st.sampled_from(["Pending", "Running", "Scaling", "Restarting",
                                                               "Suspended", PREEMPTED, None]),
                          st.floats(0, 2000), st.floats(0, 100), st.floats(0, 100)), max_size=30))
def test_never_invents_time(steps):
    g = Ledger(observed_at=0.0)
    now = 0.0
    for dt, phase, productive, stall, rollback in steps:
        now += dt
        g = observe(g, now, phase, trainer(productive, stall, rollback))
        assert g.wall_s == pytest.approx(now)
        assert g.productive_s >= -1e-9 and all(g.lost_s[c] >= -1e-9 for c in CAUSES)
        assert g.productive_s + sum(g.lost_s.values()) <= g.wall_s + 1e-6
        assert 0.0 <= g.goodput <= 1.0 + 1e-9


def gpu_condition(reason: str) -> dict:
    return {"type": "GPUHealthy", "status": "False" if reason == "MovingOffNode" else "True", "reason": reason}


def test_a_write_that_ends_a_gpu_move_prices_the_move_before_it_clears_it():
    """The tick clears MovingOffNode when the trainer reports from the new node; the ledger must charge the move
    to gpuFailover then, whenever the last refresh wrote it (a refresh after the clear sees only Running)."""
    moving = {"phase": "Running", "conditions": [gpu_condition("MovingOffNode")], "trainerTime": trainer(50.0),
              **observe(Ledger(observed_at=0.0), 100.0, "Running", trainer(50.0)).as_status()}
    patch = {"conditions": [gpu_condition("GPUsHealthy")]}
    written = settled(moving, patch, now=130.0, created=0.0)
    assert written["conditions"] == patch["conditions"]
    detail = written["goodputDetail"]
    assert (detail["lostSeconds"]["gpuFailover"], detail["wallSeconds"]) == (30.0, 130.0)
    # a patch that changes nothing the ledger prices by is written as it is
    running = {**moving, "conditions": [gpu_condition("GPUsHealthy")]}
    same = {"conditions": [gpu_condition("GPUsHealthy"), {"type": "Elastic", "status": "True", "reason": "Steady"}]}
    assert settled(running, same, now=130.0, created=0.0) == same


# ---- GPU-hours and cost (status.cost) ----

def test_gpu_seconds_follow_what_held_and_the_gpus_it_held():
    from kiln.control.goodput import gpus_held

    assert gpus_held({"phase": "Running", "nodes": 2}, 8) == 16
    assert gpus_held({"phase": "Restarting", "nodes": 2}, 8) == 16  # the pods keep their nodes' GPUs
    for idle in ({"phase": "Pending", "nodes": 2}, queued("Preempted"), {"phase": "Suspended", "nodes": 2},
                 {"phase": "Queued", "nodes": 2}):
        assert gpus_held(idle, 8) == 0, idle
    g = Ledger(observed_at=1000.0)
    g = observe(g, 1050.0, "Pending", trainer(), gpus=0)
    g = observe(g, 1150.0, "Running", trainer(80.0, stall=5.0), gpus=16)  # 15 s start-up: held, not stepping
    g = observe(g, 1170.0, "Restarting", trainer(80.0, stall=5.0), gpus=16)
    g = observe(g, 1190.0, "Running", trainer(60.0, stall=5.0), gpus=8)  # resumed at 1 node: 20 s redone
    assert g.gpu_s == pytest.approx({"productive": 60.0 * 16, "pending": 0.0, "restart": 20 * 16 + 20 * 16,
                                     "checkpointStall": 5.0 * 16, "rollback": 0.0, "suspended": 0.0,
                                     "preempted": 0.0, "gpuFailover": 0.0, "preflight": 0.0,
                                     "other": 15 * 16 + 20 * 8})


@given(st.lists(st.tuples(st.floats(0, 1e5), st.sampled_from(["Pending", "Running", "Restarting", "Suspended"]),
                          st.floats(0, 1e5), st.integers(0, 64)), max_size=20))
def test_gpu_hours_by_cause_add_up_to_the_gpus_held_times_the_time(steps):
    from kiln.control.goodput import cost

    g, now, produced, held_gpu_s = Ledger(observed_at=0.0), 0.0, 0.0, 0.0
    for dt, phase, work, gpus in steps:
        produced = max(produced, min(produced + work, now + dt))
        held_gpu_s += dt * gpus
        g = observe(g, now + dt, phase, trainer(produced), gpus=gpus)
        now += dt
    c = cost(g, 2.0, "EUR")
    assert c["gpuHours"] == pytest.approx(sum(c["gpuHoursByCause"].values()), abs=1e-3)
    assert sum(g.gpu_s.values()) <= held_gpu_s + 1e-6  # never more GPU time than was held
    assert c["amount"] == pytest.approx(c["gpuHours"] * 2.0, abs=0.01) and c["currency"] == "EUR"


def test_the_operator_writes_cost_into_status_at_the_price_of_the_runs_gpu_type():
    from kiln.control.config import Pricing
    from kiln.control.status import derive

    prices = Pricing.parse('{"NVIDIA-H200": 3.5}', "USD")
    ts = {"metadata": {"name": "r", "namespace": "ml", "creationTimestamp": "2026-01-01T00:00:00Z"},
          "spec": {"resources": {"nodes": 2, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}},
          "status": {"phase": "Running", "nodes": 2, "trainerTime": trainer(3000.0),
                     "goodputDetail": {"observedAt": "2026-01-01T00:00:00Z"}}}
    status = derive(ts, None, [], "2026-01-01T01:00:00Z", pricing=prices).status
    assert status["cost"]["gpuHours"] == 16.0  # one hour on 2 nodes x 8 GPUs
    assert status["cost"]["gpuHoursByCause"]["productive"] == pytest.approx(16.0 * 3000 / 3600, abs=1e-3)
    assert status["cost"]["amount"] == 56.0 and status["cost"]["currency"] == "USD"
    TrainingSpecStatus.model_validate(status)  # the CRD's status schema keeps every field written
    unpriced = derive({**ts, "spec": {"resources": {"nodes": 2, "gpusPerNode": 8, "gpuType": "NVIDIA-L4"}}},
                      None, [], "2026-01-01T01:00:00Z", pricing=prices).status
    assert unpriced["cost"]["gpuHours"] == 16.0 and "amount" not in unpriced["cost"]


def test_a_price_list_that_is_not_numbers_is_refused_by_name():
    from kiln.control.config import Pricing

    with pytest.raises(ValueError, match="KILN_GPU_PRICES"):
        Pricing.parse('{"NVIDIA-H200": "cheap"}')
