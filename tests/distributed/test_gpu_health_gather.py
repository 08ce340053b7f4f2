"""Every node's GPU health reaches rank 0 (kiln.trainer.guards → kiln.trainer.observe.gpu_health.gather), on real gloo ranks.

Three ranks stand for three nodes' local rank 0 (LOCAL_RANK 0, KILN_NODE_NAME per rank) plus one second
process on the last node (LOCAL_RANK 1: it probes nothing but takes part in the collective). NVML is the
FAKE pynvml (tests/fake_nvml), one state file per node; GuardHooks' own code reads and gathers it.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]

NODES = ["node-0", "node-1", "node-2", "node-2"]  # rank → node; ranks 2 and 3 share node-2
LOCAL = [0, 0, 0, 1]


def _rank(rank, world, tmp):
    import os
    from types import SimpleNamespace

    from tests.fake_nvml import pynvml as fake

    sys.modules["pynvml"] = fake  # the FAKE NVML boundary; everything above it is kiln's
    reads = []  # every NVML call reads the fake's state file: count them
    read_state = fake._state
    fake._state = lambda: (reads.append(1), read_state())[1]
    os.environ.update(FAKE_NVML_STATE=f"{tmp}/{NODES[rank]}.json", KILN_NODE_NAME=NODES[rank],
                      LOCAL_RANK=str(LOCAL[rank]))
    from kiln.trainer.guards.hooks import GuardHooks

    # A FAKE clock per rank, set before each step: rank 3's runs 3x fast, as a rank whose steps end later
    # would see more time pass. At step 3 only rank 3's interval of 50 has passed (60 vs 20): every rank must
    # still probe there, or the gather's collective would not match.
    now = [0.0]
    hooks = GuardHooks(sdc_every=0, health_interval_s=50, clock=lambda: now[0])
    records = []
    for step in (1, 2, 3, 10):
        now[0] = step * (30.0 if rank == 3 else 10.0)
        ctx = SimpleNamespace(step=step, record={}, rollback=False)
        hooks.after_update(ctx)
        records.append(ctx.record)
    return records, len(reads)


def test_rank_zero_gathers_every_nodes_gpu_states(tmp_path):
    for node, gpu in (("node-0", {}), ("node-1", {"ecc_uncorrected": 1}), ("node-2", {"temperature": 88})):
        (tmp_path / f"{node}.json").write_text(json.dumps({"gpus": [{"name": "FAKE", "slowdown": 90,
                                                                     "temperature": 50, **gpu}] * 2}))
    results = run_ranks(_rank, 4, tmp_path / "out", str(tmp_path))
    (first, second, third, tenth), _ = results[0]
    assert "gpu_health" not in second  # read at the first step, then when any rank's interval has passed
    for record in (first, third, tenth):
        states = {e["node"]: (e["state"], [g["state"] for g in e["gpus"]]) for e in record["gpu_health"]}
        assert states == {"node-0": ("Healthy", ["Healthy", "Healthy"]),
                          "node-1": ("Failing", ["Failing", "Failing"]),
                          "node-2": ("Degrading", ["Degrading", "Degrading"])}
    assert all("gpu_health" not in r for records, _ in results[1:] for r in records)  # only rank 0 reports
    assert [reads > 0 for _, reads in results] == [True, True, True, False]  # node-2's second process read nothing
