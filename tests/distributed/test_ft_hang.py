"""A replica group whose loop hangs takes itself out (kiln.trainer.ft_watch), and the other steps on.

Real processes: a torchft lighthouse and 2 replica groups, each its own torchrun job with one gloo worker
(tests/distributed/ft_group_entry.py). Group 1's loop hangs in a step the run reaches (KILN_TEST_HANG_AT: a wait
on an event that never comes, after the step's vote), while its torchft manager keeps heartbeating: without
the watch, group 0's next quorum waits for it until KILN_FT_LIGHTHOUSE_WAIT_SECONDS (300 s) and then fails.
Both groups run with a small hang floor (KILN_FT_HANG_FLOOR_SECONDS), so group 0's own watch is exercised too:
its wait for the hung peer is in torchft's quorum, which must not count as a hang of its own.
"""

from __future__ import annotations

import re

import pytest

from kiln.trainer.ft import LIGHTHOUSE_WAIT_ENV
from kiln.trainer.ft_watch import HANG_EXIT_CODE, HANG_FLOOR_ENV
from tests.distributed.ft_helpers import Group, lighthouse_server, records
from tests.distributed.ranks import wait_until
from tests.distributed.trainer_helpers import write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, HANG_AT = 40, 12  # the rule gives a verdict only after 5 step times: hang past them
FLOOR_S = 5  # small for the test, above a loaded machine's pauses; a slow machine's p99 x 10 raises the limit
LIGHTHOUSE_WAIT_S = 300  # the default: what a quorum waited for a hung group before
PER_GROUP, SEQ = 2, 32  # globalBatchSize 4 over 2 groups; the micro model's seqLen


def test_a_hung_group_leaves_the_quorum_and_the_other_steps_on_alone(tmp_path):
    spec = write_spec(tmp_path / "ft.yaml", training={"steps": STEPS},
                      checkpoint={"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": 1000},
                      resources={"processesPerNode": 2},  # the whole job: 2 groups x 1 process
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    watch = {HANG_FLOOR_ENV: str(FLOOR_S), LIGHTHOUSE_WAIT_ENV: str(LIGHTHOUSE_WAIT_S)}
    server = lighthouse_server()
    groups: list[Group] = []
    try:
        g0 = Group(0, spec, tmp_path / "g0", server.address(), tmp_path, "g0", extra_env=watch)
        g1 = Group(1, spec, tmp_path / "g1", server.address(), tmp_path, "g1",
                   extra_env={**watch, "KILN_TEST_HANG_AT": str(HANG_AT)})
        groups += [g0, g1]
        Group.release(g0, g1)
        # the hung group ends by itself; group 0 must not fail first (its quorum waiting out the lighthouse wait)
        wait_until("the hung group 1 to end itself", lambda: not g1.alive(), alive=g0.alive, context=g0.log)
        log1 = g1.log_path.read_text()
        assert g1.finish() != 0, log1[-3000:]
        assert g0.finish() == 0, g0.log()
    finally:
        for g in groups:
            g.stop()
        server.shutdown()

    # One line names the cause; the worker exited with the hang's code (torchrun reports it).
    (line,) = [x for x in log1.splitlines() if "kiln: ft: group 1 hung:" in x]
    assert "no training step completed for" in line and "leaving the quorum" in line, line
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", log1), log1[-3000:]
    run0, run1 = records(g0.out), records(g1.out)
    assert [r["step"] for r in run1] == list(range(1, HANG_AT)), "group 1 logged every step before its hang"

    # Group 0 took every step once, with group 1 up to the hung step (its vote was in), then alone to the end.
    assert [r["step"] for r in run0] == list(range(1, STEPS + 1))
    assert {r["ft_participants"] for r in run0 if r["step"] <= HANG_AT} == {2}
    assert {r["ft_participants"] for r in run0 if r["step"] > HANG_AT} == {1}
    assert run0[-1]["ft_redone_steps"] == 0
    assert run0[-1]["tokens_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP * SEQ

    # Its quorum without group 1 waited for the hang watch and the lighthouse's heartbeat timeout, nowhere near
    # the lighthouse wait.
    waited = max(r["ft_quorum_s"] for r in run0)
    limit = float(re.search(r"limit (\d+)s", line).group(1))
    print(f"hang: {line}\nhang: group 1 hung in step {HANG_AT}, left at its limit {limit:.0f} s; group 0's longest "
          f"quorum {waited:.1f} s (lighthouse wait {LIGHTHOUSE_WAIT_S} s)")
    assert waited < LIGHTHOUSE_WAIT_S / 5, (waited, limit)
