"""What a fault costs on the fault benchmarks (tests/bench/fault_cost.py): a run's timeline through the operator's
goodput ledger and status.cost, the faulty run's less the reference's per fault; and the trainer's counters
replayed from its metrics lines (tests.support.ranks.trainer_time), as the benchmarks feed them."""

from __future__ import annotations

import json

import pytest

from tests.bench.fault_cost import per_fault, priced, timeline
from tests.support.ranks import trainer_time

DEVICES = 2
PRICE = 360.0  # per device-hour: 10 device-seconds cost 1.0


def counters(productive: float, stall: float) -> dict:
    return {"productiveSeconds": productive, "checkpointStallSeconds": stall}


def test_a_kill_costs_its_restarting_time_and_the_steps_redone_at_every_device_held():
    # The reference: 100 s, 80 s stepping, 2 s blocked on saves, 18 s start-up and the like.
    reference = {"kills": [], "wall_s": 100.0, "trainer_time": counters(80, 2)}
    # The faulty run does the same work, and one kill at 50 s: the workers are back stepping 10 s later from a
    # commit 4 s of steps older than where the killed ones were (those 4 s are done again).
    faulty = {"kills": [{"at_s": 50.0, "trainer_time_at_kill": counters(40, 1), "kill_to_step_s": 10.0,
                         "trainer_time_at_step": counters(36, 1)}],
              "wall_s": 114.0, "trainer_time": counters(80, 2)}
    ref, bad = (priced(timeline(run), DEVICES, PRICE, "EUR") for run in (reference, faulty))
    assert ref["device_seconds"] == {**dict.fromkeys(ref["device_seconds"], 0.0),
                                     "productive": 160.0, "checkpointStall": 4.0, "other": 36.0}
    assert bad["gpuHours"] == pytest.approx(114 * DEVICES / 3600, abs=1e-4)  # every second held, once
    assert sum(bad["gpuHoursByCause"].values()) == pytest.approx(bad["gpuHours"], abs=1e-3)

    lost = per_fault(bad, ref, 1, PRICE, "EUR")
    assert lost["device_seconds"] == {**dict.fromkeys(lost["device_seconds"], 0.0), "restart": (10 + 4) * DEVICES}
    assert lost["gpuHoursByCause"]["restart"] == lost["gpuHours"] == pytest.approx(28 / 3600, abs=1e-4)
    assert lost["amount"] == lost["amountByCause"]["restart"] == 2.8 and lost["currency"] == "EUR"
    assert per_fault(bad, ref, 0, PRICE, "EUR") is None  # no fault, no cost per fault


def test_two_kills_share_the_difference():
    reference = {"kills": [], "wall_s": 100.0, "trainer_time": counters(80, 0)}
    kill = {"trainer_time_at_kill": counters(40, 0), "kill_to_step_s": 5.0, "trainer_time_at_step": counters(40, 0)}
    faulty = {"kills": [{**kill, "at_s": 50.0}, {**kill, "at_s": 55.0}], "wall_s": 110.0,
              "trainer_time": counters(80, 0)}
    bad, ref = (priced(timeline(run), DEVICES, PRICE, "USD") for run in (faulty, reference))
    lost = per_fault(bad, ref, 2, PRICE, "USD")
    assert lost["device_seconds"]["restart"] == 5 * DEVICES and lost["amount"] == 1.0


def test_trainer_time_replays_the_records_as_rank_0_counted_them():
    records = [{"step": 1, "step_s": 1.0}, {"step": 2, "step_s": 1.5, "checkpoint_stall_s": 0.25},
               {"step": 3, "step_s": 2.0}]
    lines = [json.dumps(r) for r in records]
    assert trainer_time(lines + [""]) == {"productiveSeconds": 4.5, "checkpointStallSeconds": 0.25,
                                          "rollbackSeconds": 0.0, "preflightSeconds": 0.0}
    # a resume truncated the file to its commit (step 2): what that commit carried
    assert trainer_time(lines[:2])["productiveSeconds"] == 2.5
