"""A replica group whose loop hangs takes itself out (kiln.trainer.membership.hang_watch), and the other steps on.

Real processes: a torchft lighthouse and 2 replica groups, each its own torchrun job with one gloo worker
(tests/distributed/ft_group_entry.py). Group 1's loop hangs in a step the run reaches (KILN_TEST_HANG_AT: a wait
on an event that never comes, after the step's vote), while its torchft manager keeps heartbeating: without
the watch, group 0's next quorum waits for it until KILN_FT_LIGHTHOUSE_WAIT_SECONDS (300 s) and then fails.
Both groups run with a small hang floor (KILN_FT_HANG_FLOOR_SECONDS), so group 0's own watch is exercised too:
its wait for the hung peer is in torchft's quorum, which must not count as a hang of its own. Group 1's restart
(started early and held at its gate, as in test_ft_replica_groups) then heals from group 0.
"""

from __future__ import annotations

import re

import pytest

from kiln.trainer.membership.hang_watch import HANG_EXIT_CODE, HANG_FLOOR_ENV
from kiln.trainer.membership.replica_groups import LIGHTHOUSE_WAIT_ENV
from kiln.trainer.observe.hang_report import main_stack
from tests.distributed.ft_helpers import Group, bring_back, lighthouse_server, records
from tests.support.ranks import wait_until
from tests.support.runs import write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, HANG_AT = 80, 12  # the rule gives a verdict only after 5 step times: hang past them
ALONE = 3  # steps group 0 reports alone before group 1's restart is let go
FLOOR_S = 5  # small for the test, above a loaded machine's pauses; a slow machine's p99 x 10 raises the limit
LIGHTHOUSE_WAIT_S = 300  # the default: what a quorum waited for a hung group before
PER_GROUP, SEQ = 2, 32  # globalBatchSize 4 over 2 groups; the micro model's seqLen


def test_a_hung_group_leaves_the_quorum_the_other_steps_on_and_its_restart_heals(tmp_path):
    spec = write_spec(tmp_path / "ft.yaml", training={"steps": STEPS},
                      checkpoint={"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": 1000},
                      resources={"processesPerNode": 2},  # the whole job: 2 groups x 1 process
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    watch = {HANG_FLOOR_ENV: str(FLOOR_S), LIGHTHOUSE_WAIT_ENV: str(LIGHTHOUSE_WAIT_S)}
    server = lighthouse_server()
    groups: list[Group] = []
    try:
        # group 0 is frozen while group 1's restart comes back (below): its calls in flight must not time out
        g0 = Group(0, spec, tmp_path / "g0", server.address(), tmp_path, "g0",
                   extra_env={**watch, "TORCHFT_TIMEOUT_SEC": "600"})
        g1 = Group(1, spec, tmp_path / "g1", server.address(), tmp_path, "g1",
                   extra_env={**watch, "KILN_TEST_HANG_AT": str(HANG_AT)})
        # the restart of group 1 (its pod's or torchrun's), started now and held at its gate after its imports
        g1b = Group(1, spec, tmp_path / "g1b", server.address(), tmp_path, "g1b", extra_env=watch)
        groups += [g0, g1, g1b]
        Group.release(g0, g1)
        # group 1 takes itself out, so group 0 steps alone (it must not fail first: its quorum waiting out the
        # lighthouse wait)
        wait_until(f"{ALONE} steps of group 0 alone", lambda: sum(r["ft_participants"] == 1 for r in records(g0.out))
                   >= ALONE, alive=g0.alive, context=g0.log)
        # The restart's start after its gate (model, warm-up, join) can outlast group 0's remaining steps on a
        # loaded machine: group 0 is frozen until the restart is at the lighthouse (alone), then goes on. Its
        # own hang watch must not count the freeze (kiln.trainer.membership.hang_watch.HangWatch.frozen).
        bring_back(g0, g1b)
        g1.finish()  # the hung group's worker left (group 0 stepped alone); its torchrun ends too
        log1 = g1.log_path.read_text()
        assert g0.finish() == 0, g0.log()
        assert g1b.finish() == 0, g1b.log()
        assert g1.proc.returncode != 0, log1[-3000:]
    finally:
        for g in groups:
            g.stop()
        server.shutdown()

    # One line names the cause; the worker exited with the hang's code (torchrun reports it).
    (line,) = [x for x in log1.splitlines() if "kiln: ft: group 1 hung:" in x]
    assert "no training step completed for" in line and "leaving the quorum" in line, line
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", log1), log1[-3000:]
    run0, run1, back = records(g0.out), records(g1.out), records(g1b.out)
    assert [r["step"] for r in run1] == list(range(1, HANG_AT)), "group 1 logged every step before its hang"
    # before it left, the hung group's rank wrote its stacks (where it hangs) to the run's store; no other did
    (folder,) = (tmp_path / "ckpt" / "incidents" / "hang").iterdir()
    assert folder.name.endswith("-group-1"), folder.name
    stacks = (folder / "rank-0.txt").read_text()
    assert stacks.startswith(f"step {HANG_AT}: no training step completed for"), stacks[:300]
    assert "ft_group_entry.py" in main_stack(stacks), stacks  # its main thread, where the test made it wait
    assert (folder / "flight-recorder" / "rank-0").stat().st_size > 0  # gloo's flight recorder

    # Group 0 took every step once: with group 1 up to the hung step (its vote was in), then alone, then with
    # the restarted group 1 to the end.
    assert [r["step"] for r in run0] == list(range(1, STEPS + 1))
    assert {r["ft_participants"] for r in run0 if r["step"] <= HANG_AT} == {2}
    alone = [r["step"] for r in run0 if r["ft_participants"] == 1]
    assert len(alone) >= ALONE and alone == list(range(HANG_AT + 1, alone[-1] + 1)), alone
    assert {r["ft_participants"] for r in run0 if r["step"] > alone[-1]} == {2}
    assert run0[-1]["ft_redone_steps"] == 0
    assert run0[-1]["tokens_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP * SEQ

    # The restart healed from group 0 (no commit exists) and both end with the same weights and data cursor.
    assert back[0]["ft_restore"] == "peer" and back[0]["step"] == alone[-1] + 1, back[0]
    assert back[-1]["ft_weights_digest"] == run0[-1]["ft_weights_digest"]
    assert back[-1]["tokens_seen"] == run0[-1]["tokens_seen"]

    # Group 0's first quorum without group 1 waited for the hang watch and the lighthouse's heartbeat timeout,
    # nowhere near the lighthouse wait.
    waited = run0[HANG_AT]["ft_quorum_s"]  # the quorum of step HANG_AT + 1
    limit = float(re.search(r"limit (\d+)s", line).group(1))
    print(f"hang: {line}\nhang: group 1 hung in step {HANG_AT}, left at its limit {limit:.0f} s; group 0's quorum "
          f"without it waited {waited:.1f} s (lighthouse wait {LIGHTHOUSE_WAIT_S} s); {len(alone)} step(s) alone, "
          f"the restart healed at step {back[0]['step'] - 1}")
    assert waited < LIGHTHOUSE_WAIT_S / 5, (waited, limit)
