"""Replica groups outlive their lighthouse: it is killed (SIGKILL) while 2 groups train and started again on
the same address, as its Deployment restarts it; the groups wait, reconnect and step on to the end, in the
same processes, and end with the same weights.

Real processes throughout: `torchft_lighthouse` with the flags the operator renders (kiln.control.plan), and
2 replica groups, each its own `torchrun --standalone` with one gloo worker. The kill is at a step the groups
report, and the new lighthouse is started as soon as the old one has exited; nothing waits on a clock. Every
step past the kill needs a quorum, which only the new lighthouse can give.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.api import contract
from kiln.control.plan import LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS, LIGHTHOUSE_JOIN_TIMEOUT_MS
from tests.distributed.ft_helpers import Group, die_with_parent, records
from tests.support.ranks import free_port, wait_until
from tests.support.runs import env, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 40
KILL_AT = 5  # the lighthouse dies once both groups report this step together
PER_GROUP, SEQ = 2, 32  # globalBatchSize 4 over 2 groups; the micro model's seqLen


class Lighthouse:
    """The lighthouse (the operator's entry, kiln.cli.lighthouse) as a process of its own, on a fixed port (a restart binds the same one)."""

    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log
        with log.open("a") as sink:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).with_name("kiln-lighthouse")), "--min_replicas", "1",
                 "--join_timeout_ms", str(LIGHTHOUSE_JOIN_TIMEOUT_MS),
                 "--heartbeat_timeout_ms", str(LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS),
                 "--quorum_tick_ms", str(contract.FT_QUORUM_TICK_MS), "--bind", f"[::]:{port}"],
                env=env(**die_with_parent()), stdout=sink, stderr=subprocess.STDOUT)

    def listening(self) -> bool:
        try:
            socket.create_connection(("localhost", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_groups_step_on_through_a_lighthouse_restart(tmp_path):
    port = free_port()
    lighthouse = Lighthouse(port, tmp_path / "lighthouse.log")
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": STEPS},
                      checkpoint={"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": 1000},
                      resources={"processesPerNode": 2},
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    groups = [Group(i, spec, tmp_path / f"g{i}", f"http://localhost:{port}", tmp_path, f"g{i}") for i in range(2)]
    try:
        wait_until("the lighthouse listening", lighthouse.listening, alive=lambda: lighthouse.proc.poll() is None,
                   context=lighthouse.log.read_text)
        Group.release(*groups)
        for g in groups:
            wait_until(f"group {g.index} at step {KILL_AT} with both groups",
                       lambda g=g: [r for r in records(g.out) if r["step"] >= KILL_AT and r["ft_participants"] == 2],
                       alive=g.alive, context=g.log)
        lighthouse.kill()
        killed_at = max(records(g.out)[-1]["step"] for g in groups)
        assert killed_at < STEPS - 1
        lighthouse = Lighthouse(port, tmp_path / "lighthouse.log")  # its Deployment brings it back
        for g in groups:
            assert g.finish() == 0, g.log()
    finally:
        for g in groups:
            g.stop()
        lighthouse.kill()

    runs = [records(g.out) for g in groups]
    for run in runs:
        # the same process to the end, never back to an earlier step and no commit read; a group may skip steps
        # the other took alone while it reconnected (it heals from that peer)
        steps = [r["step"] for r in run]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS and steps[:KILL_AT] == list(range(1, KILL_AT + 1))
        assert "checkpoint" not in {r["ft_restore"] for r in run}
    # one chain of steps: each step taken once by the job (by whichever groups were in its quorum), and the data
    # cursor moved by exactly what those groups read — nothing skipped or read twice across the restart
    job = {r["step"]: r["ft_participants"] for run in runs for r in run}
    assert sorted(job) == list(range(1, STEPS + 1))
    for run in runs:
        assert all(job[r["step"]] == r["ft_participants"] for r in run)
    assert runs[0][-1]["tokens_seen"] == runs[1][-1]["tokens_seen"] == sum(job.values()) * PER_GROUP * SEQ
    assert runs[0][-1]["ft_participants"] == runs[1][-1]["ft_participants"] == 2
    assert runs[0][-1]["ft_weights_digest"] == runs[1][-1]["ft_weights_digest"]
    print(f"lighthouse killed at step {killed_at}; steps taken by one group: "
          f"{[s for s, k in sorted(job.items()) if k == 1]}; heals {[run[-1]['ft_heals'] for run in runs]}, "
          f"redone steps {[run[-1]['ft_redone_steps'] for run in runs]}")
