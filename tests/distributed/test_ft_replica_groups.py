"""elastic.faultTolerance replicaGroups with real processes: a torchft lighthouse and 2 replica groups, each its
own torchrun job (1 gloo rank; 2 ranks, FSDP2 or tensor parallel inside the group, in the two-rank test), kill
one group at a step it reports, the other keeps stepping, the killed group comes back and heals from its live
peer (no checkpoint read), both end with the same weights (rank by rank).

The groups run `kiln train` through tests/distributed/ft_group_entry.py, which holds each worker at a gate
after its imports; the test releases a group when the run reports a given step, never after a delay. The entry
also logs the run events the trainer's hooks receive (kiln.trainer.hooks): the tests check that a quorum change,
a heal and a restart from a commit each reach them, once, at the step where they happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.storage.commit import read_trainer_state
from kiln.storage.store import open_store
from tests.distributed.ft_helpers import (Group, die_with_parent, heartbeating, kill_and_bring_back, lighthouse_server,
                                          records)
from tests.support.ranks import SAFETY_TIMEOUT_S, _children, run_ranks, wait_until
from tests.support.runs import env, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 60  # past the freeze (~step 16; kill_and_bring_back holds the survivor until the returning group is
# back at the lighthouse, so no margin of steps is needed for its start): room to rejoin, heal and step on
KILL_AT = 10  # group 1 is killed once it reports this step with both groups in the quorum
ALONE = 5  # group 0 must report this many steps alone before group 1 comes back
PER_GROUP, SEQ = 2, 32  # globalBatchSize 4 over 2 groups; the micro model's seqLen


@pytest.fixture
def lighthouse():
    server = lighthouse_server()
    yield server.address()
    server.shutdown()


def events(out: Path, kind: str) -> list[dict]:
    """The run events of `kind` the group's hooks received (ft_group_entry.py), in order."""
    path = out / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.pop("event") == kind]


def ft_spec(tmp: Path, name: str) -> Path:
    return write_spec(tmp / f"{name}.yaml", training={"steps": STEPS},
                      checkpoint={"uri": f"file://{tmp / name / 'ckpt'}", "intervalSteps": 1000},
                      resources={"processesPerNode": 2},  # the whole job: 2 groups × 1 process
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})


def test_a_killed_group_heals_from_its_peer_while_the_other_keeps_stepping(tmp_path, lighthouse):
    groups: list[Group] = []
    try:
        # Fault-free reference: both groups released together, every step with both.
        spec = ft_spec(tmp_path, "ref")
        ref = [Group(i, spec, tmp_path / "ref" / f"g{i}", lighthouse, tmp_path, f"ref{i}") for i in range(2)]
        groups += ref
        Group.release(*ref)
        for g in ref:
            assert g.finish() == 0, g.log()
        ref0 = records(ref[0].out)

        # Faulty run, with its own checkpoint store. The replacement for group 1 starts now, held at its gate,
        # so that once released it rejoins within a step or two (its imports are done).
        spec = ft_spec(tmp_path, "ft")
        # group 0 is frozen while group 1 comes back (below): its calls in flight then must not time out
        g0, g1, g1b = (Group(0, spec, tmp_path / "ft" / "g0", lighthouse, tmp_path, "g0",
                             extra_env={"TORCHFT_TIMEOUT_SEC": "600"}),
                       Group(1, spec, tmp_path / "ft" / "g1", lighthouse, tmp_path, "g1"),
                       Group(1, spec, tmp_path / "ft" / "g1b", lighthouse, tmp_path, "g1b"))
        groups += [g0, g1, g1b]
        Group.release(g0, g1)
        # Group 1 is killed at step KILL_AT and group 0 keeps stepping alone while it is down. Group 1's start
        # after the gate (model, warm-up, join) takes longer than group 0's remaining steps on a loaded machine,
        # so group 0 is frozen until group 1 is back at the lighthouse, then goes on: the next quorum holds both.
        killed_at, alone, frozen_at = kill_and_bring_back(g0, g1, g1b, kill_at=KILL_AT, alone=ALONE,
                                                          ckpt=tmp_path / "ft" / "ckpt")
        assert frozen_at < STEPS, "group 0 finished before group 1 could come back"
        assert g0.finish() == 0, g0.log()
        assert g1b.finish() == 0, g1b.log()
    finally:
        for g in groups:
            g.stop()

    run0, back = records(g0.out), records(g1b.out)
    # Group 0 never stopped: every step once, in order, and none redone after the first quorum change.
    assert [r["step"] for r in run0] == list(range(1, STEPS + 1))
    degraded = [r["step"] for r in run0 if r["ft_participants"] == 1]
    assert len(degraded) >= ALONE and degraded == list(range(degraded[0], degraded[-1] + 1))
    assert run0[-1]["ft_participants"] == 2, "group 1 must be back before the end"

    # The returning group healed from its live peer: it started past the kill, from a peer, no commit read.
    first = back[0]
    # ... and warmed its step up before it asked for the quorum (test_the_warm_up_before_a_join_changes_no_state)
    marks = first["startup"]
    assert marks["model_built"] <= marks["warmed_up"] <= marks["joining"] <= marks["restored"], marks
    assert first["ft_restore"] == "peer" and first["ft_heals"] == 1, first
    assert first["step"] > alone[-1]["step"] > killed_at
    assert "healed from a live peer" in g1b.log_path.read_text()
    assert [r["step"] for r in back] == list(range(first["step"], STEPS + 1))

    # Both end with bit-identical weights, and the same loss and data cursor.
    assert back[-1]["ft_weights_digest"] == run0[-1]["ft_weights_digest"]
    assert back[-1]["loss"] == run0[-1]["loss"] and back[-1]["tokens_seen"] == run0[-1]["tokens_seen"]
    # The cursor moved by exactly the samples the live groups read: none skipped, none read twice.
    assert run0[-1]["tokens_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP * SEQ
    assert ref0[-1]["tokens_seen"] == STEPS * 2 * PER_GROUP * SEQ
    # The hooks saw each event once, where it happened: group 0 the quorum without group 1 after its last step
    # with it and the quorum with it again after its last step alone; the returning group the heal, at the step
    # of that quorum (it takes part in the next one); neither a restart from a commit.
    changes, (heal,) = events(g0.out, "membership_change"), events(g1b.out, "heal")
    assert len(changes) == run0[-1]["ft_quorum_changes"] and {c["participants"] for c in changes} == {1, 2}
    drop, rejoin = next(c for c in changes if c["participants"] == 1), changes[-1]
    assert drop["step"] == degraded[0] - 1 and drop["groups"] == 2, changes
    assert rejoin["participants"] == 2 and rejoin["step"] == degraded[-1] == heal["step"] == first["step"] - 1
    assert heal["at_start"] and heal["tokens_seen"] == run0[heal["step"] - 1]["tokens_seen"]
    assert not events(g0.out, "heal")
    # the returning group's first quorum held it alone (group 0 was frozen); its one change is group 0's return
    (joined,) = events(g1b.out, "membership_change")
    assert joined["participants"] == 2 and joined["step"] == heal["step"]
    assert not events(g0.out, "restart") and not events(g1b.out, "restart")
    # Only one group wrote the final commit, and it holds the last step.
    assert (tmp_path / "ft" / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:08d}"

    # The held-out loss ends close to the fault-free run's (the degraded steps averaged half the batch; the
    # last training batch itself differs, as the cursor moved less).
    final, want = run0[-1]["val_loss"], ref0[-1]["val_loss"]
    print(f"ft: killed at step {killed_at}, {len(degraded)} step(s) alone ({degraded[0]}..{degraded[-1]}), "
          f"group 1 back at step {first['step']}; validation loss {final:.5f} vs fault-free {want:.5f} "
          f"({(final - want) / want:+.3%})")
    assert final == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("parallelism", [{"fsdp": True}, {"tensor": 2}], ids=["fsdp2", "tp2"])
def test_a_killed_group_of_two_ranks_heals_each_rank_from_the_same_rank_of_its_peer(tmp_path, lighthouse,
                                                                                    parallelism):
    """2 replica groups × 2 ranks (the group's own layout inside: FSDP2 over its 2 ranks): each rank averages
    its shard with the same rank of the other group, and a group that comes back heals rank by rank (rank r
    receives rank r's shard and optimizer state of the live peer). Group 1 (torchrun and both workers) is killed
    at a step it reports, group 0 steps on alone, the replacement heals from it without a commit to read, and
    both end with the same weights on every rank, the same data cursor, every sample read once. The fault, the
    gating and the freeze are the one-rank test's (ft_helpers.kill_and_bring_back)."""
    steps, kill_at, alone_steps = 30, 3, 2
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": steps},
                      checkpoint={"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": 1000},
                      parallelism=parallelism,
                      resources={"processesPerNode": 4},  # the whole job: 2 groups × 2 processes
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    group = lambda i, name, **kw: Group(i, spec, tmp_path / name, lighthouse, tmp_path, name, nproc=2, **kw)  # noqa: E731
    # group 0 is frozen while group 1 comes back: its calls in flight then must not time out
    g0, g1, g1b = group(0, "g0", extra_env={"TORCHFT_TIMEOUT_SEC": "600"}), group(1, "g1"), group(1, "g1b")
    try:
        Group.release(g0, g1)
        killed_at, _, frozen_at = kill_and_bring_back(g0, g1, g1b, kill_at=kill_at, alone=alone_steps,
                                                      ckpt=tmp_path / "ckpt")
        assert frozen_at < steps, "group 0 finished before group 1 could come back"
        assert g0.finish() == 0, g0.log()
        assert g1b.finish() == 0, g1b.log()
    finally:
        for g in (g0, g1, g1b):
            g.stop()

    run0, back = records(g0.out), records(g1b.out)
    assert [r["step"] for r in run0] == list(range(1, steps + 1))
    assert all(r["world_size"] == 2 for r in run0 + back)  # each group its own 2-rank world
    # The returning group healed from its live peer, past the freeze, and read no commit.
    first = back[0]
    assert first["ft_restore"] == "peer" and first["ft_heals"] == 1 and first["step"] > frozen_at, first
    assert [r["step"] for r in back] == list(range(first["step"], steps + 1))
    (heal,) = events(g1b.out, "heal")
    assert heal["at_start"] and heal["step"] == first["step"] - 1
    assert not events(g1b.out, "restart") and not events(g0.out, "heal")
    assert any(r["ft_participants"] == 1 for r in run0 if killed_at < r["step"] < first["step"])
    # Rank by rank, both groups end with the same weights: rank r of group 1 equals rank r of group 0, and
    # the two ranks hold different shards (the digest covers each rank's own part, not a copy).
    mine, peer = run0[-1]["ft_weights_digest"].split(","), back[-1]["ft_weights_digest"].split(",")
    assert len(mine) == 2 and mine[0] != mine[1] and mine == peer, (mine, peer)
    assert back[-1]["loss"] == run0[-1]["loss"] and back[-1]["tokens_seen"] == run0[-1]["tokens_seen"]
    # Every sample read once: the cursor moved by what the live groups read, in the logs and in the final commit.
    assert run0[-1]["tokens_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP * SEQ
    state = read_trainer_state(open_store(f"file://{tmp_path / 'ckpt'}"), steps)
    assert state["data"]["samples_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP


def _decide_rank(rank: int, world: int) -> list[bool]:
    from kiln.trainer.membership.replica_groups import rank0_decides

    return [rank0_decides(rank == 0), rank0_decides(rank != 0)]


def test_the_ranks_of_a_group_end_their_start_wait_together(tmp_path):
    """A group waits at its start for the other groups, asking the lighthouse again until its start wait is up
    (ReplicaGroups.join). Every rank must ask for the same quorums (torchft's manager server waits for all of
    the group's ranks), so the end of the wait, read from each rank's own clock, is rank 0's for all: a rank
    whose clock says stop while rank 0's says go on goes on, and the other way round."""
    assert run_ranks(_decide_rank, 2, tmp_path) == [[True, False], [True, False]]


def test_a_whole_job_restart_resumes_every_group_from_the_newest_commit(tmp_path, lighthouse):
    """Both groups lost at once: the first group back finds nobody ahead of it and restores the newest commit
    (written by the replica-rank-0 group); the other restores it too, or, when it asks for its first quorum
    after the first one is back at that commit, heals from it (torchft: the one behind recovers from a live
    peer; which happens depends on the machine's load). Either way the job resumes at the commit's step and
    ends bit-identical to a fault-free run."""
    steps, interval = 30, 10
    groups: list[Group] = []

    def spec_for(name: str) -> Path:
        return write_spec(tmp_path / f"{name}.yaml", training={"steps": steps},
                          checkpoint={"uri": f"file://{tmp_path / name / 'ckpt'}", "intervalSteps": interval},
                          resources={"processesPerNode": 2},
                          elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})

    def start(spec: Path, name: str, out: str) -> list[Group]:
        started = [Group(i, spec, tmp_path / out / f"g{i}", lighthouse, tmp_path, f"{name}{i}") for i in range(2)]
        groups.extend(started)
        return started

    try:
        ref = start(spec_for("ref"), "ref", "ref")
        Group.release(*ref)
        assert [g.finish() for g in ref] == [0, 0], ref[0].log() + ref[1].log()

        spec = spec_for("ft")
        # the restarted pair starts now and waits at its gates; it logs where the killed pair did
        first, again = start(spec, "ft", "ft"), start(spec, "again", "ft")
        Group.release(*first)
        wait_until(f"a commit past step {interval} and step {interval + 5}",
                   lambda: (tmp_path / "ft" / "ckpt" / f"step-{interval:08d}" / "COMMIT").exists()
                   and records(first[1].out)[-1:] and records(first[1].out)[-1]["step"] >= interval + 5,
                   alive=first[1].alive, context=first[1].log)
        for g in first:
            g.kill()
        latest = int((tmp_path / "ft" / "ckpt" / "latest").read_text().strip().removeprefix("step-"))
        assert interval <= latest < steps
        # a restarted job comes back after its lost groups' heartbeats are old, as pods do: until then the
        # lighthouse would still put them in the first quorum, as peers to heal from
        wait_until("the lighthouse to see no live group", lambda: heartbeating(lighthouse) == 0)
        Group.release(*again)
        assert [g.finish() for g in again] == [0, 0], again[0].log() + again[1].log()
    finally:
        for g in groups:
            g.stop()

    sources = []
    for i in range(2):
        got = records(tmp_path / "ft" / f"g{i}")
        resumed = [r for r in got if r["step"] > latest]
        sources.append(resumed[0]["ft_restore"])
        out = tmp_path / "ft" / f"g{i}"
        at_commit = {"step": latest, "tokens_seen": latest * 2 * PER_GROUP * SEQ}
        if sources[-1] == "checkpoint":  # its hooks saw one restart, from the newest commit, and no heal
            assert resumed[0]["ft_heals"] == 0, resumed[0]
            assert events(out, "restart") == [at_commit]
            assert events(out, "heal") == []
        else:  # healed at its start from the group already back at the commit: no read of the store
            assert sources[-1] == "peer" and resumed[0]["ft_heals"] == 1, resumed[0]
            assert events(out, "restart") == []
            assert events(out, "heal") == [at_commit | {"at_start": True}]
        assert [r["step"] for r in got] == list(range(1, steps + 1))
        want = records(tmp_path / "ref" / f"g{i}")
        assert all(r["ft_participants"] == 2 for r in want + resumed)
        # Exact resume: the same losses from the commit on, and the same final weights, as without the fault.
        assert [r["loss"] for r in resumed] == [r["loss"] for r in want if r["step"] > latest]
        assert resumed[-1]["ft_weights_digest"] == want[-1]["ft_weights_digest"]
    assert "checkpoint" in sources, "the first group back had nobody to heal from: it must read the commit"


def _stopped(group: Group) -> bool:
    """Whether the group's worker has stopped itself (ft_group_entry: SIGSTOP, state T in /proc)."""
    for pid in group._tree()[1:]:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return True
        except (OSError, IndexError):
            continue
    return False


def test_a_guard_rollback_takes_every_live_group_back_to_the_commit_together(tmp_path, lighthouse):
    """Repeated loss spikes (kiln.trainer.guards) in replica-group mode, alone and with a peer. Group 0 starts
    alone (group 1 held at its gate): three spikes from step 11 roll it back to the commit of step 10, read
    from the store (no peer exists). It then stops itself until group 1 is at the lighthouse, and group 1 heals
    from it: from the rolled-back state, never the spiked one. Three spikes from step 21, both live, then roll
    both back at the same step to the commit of step 20, each reading it itself (both hold the weights that
    spiked: no peer has better ones), and neither heals afterwards: they agree on where they are. Spikes are
    injected into the global loss by the test entry (ft_group_entry: KILN_TEST_SPIKES), keyed on the guards'
    rollback count and the quorum, so both groups inject at the same steps and a redone step is clean."""
    steps, interval = 30, 10
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": steps},
                      checkpoint={"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": interval,
                                  "asyncSave": False},  # the commit of step 20 is whole before step 21 starts
                      resources={"processesPerNode": 2},
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    spikes = {"KILN_TEST_SPIKES": json.dumps([[1, 11], [2, 21]])}
    g0 = Group(0, spec, tmp_path / "g0", lighthouse, tmp_path, "g0",
               extra_env={**spikes, "KILN_FT_START_WAIT_SECONDS": "0"})  # group 0 steps alone at once
    g1 = Group(1, spec, tmp_path / "g1", lighthouse, tmp_path, "g1", extra_env=spikes)
    try:
        Group.release(g0)
        wait_until("group 0 stopped after its rollback alone", lambda: _stopped(g0), alive=g0.alive, context=g0.log)
        Group.release(g1)
        wait_until("group 1 at the lighthouse", lambda: "kiln: ft: group 1: quorum" in g1.log_path.read_text(),
                   alive=g1.alive, context=g1.log)
        g0.signal(signal.SIGCONT)
        assert g0.finish() == 0, g0.log()
        assert g1.finish() == 0, g1.log()
    finally:
        for g in (g0, g1):
            g.stop()

    run0, run1 = records(g0.out), records(g1.out)
    # Alone: skip, skip, rollback to the commit of step 10, then step 11 again, past the spiked data.
    first_back = run1[0]["step"]
    assert [r["step"] for r in run0] == [*range(1, 14), *range(11, 24), *range(21, steps + 1)]
    alone = run0[10:13]
    assert [(r["guard_action"], r["ft_participants"]) for r in alone] == [("skip", 1), ("skip", 1), ("rollback", 1)]
    assert alone[-1]["rolled_back_to"] == interval and "steps 11..13" in alone[-1]["guard_reason"]
    # Group 1 healed from group 0 after the rollback: at a step past the commit, not from the spiked steps.
    assert run1[0]["ft_restore"] == "peer" and interval < first_back <= 21, run1[0]
    (heal,) = events(g1.out, "heal")
    assert heal["step"] == first_back - 1 and heal["at_start"]
    # Together: both decide the rollback at the same step, both go back to the commit of step 20.
    for run in (run0, run1):
        together = [r for r in run if r.get("guard_action") in ("skip", "rollback") and r["ft_participants"] == 2]
        assert [(r["step"], r["guard_action"]) for r in together] == [(21, "skip"), (22, "skip"), (23, "rollback")]
        assert together[-1]["rolled_back_to"] == 2 * interval
        assert run[run.index(together[-1]) + 1]["step"] == 21
        assert run[-1]["guard_rollbacks"] == 2  # the job's: group 1 received the count with its heal
    assert [r["step"] for r in run1] == [*range(first_back, 24), *range(21, steps + 1)]
    # ... and neither healed afterwards: they restored the same commit and agree to the bit at the end.
    assert run0[-1]["ft_heals"] == 0 and run1[-1]["ft_heals"] == 1
    assert run0[-1]["ft_weights_digest"] == run1[-1]["ft_weights_digest"] and run0[-1]["loss"] == run1[-1]["loss"]
    assert not events(g0.out, "restart") and not events(g1.out, "restart")  # a rollback is not a restart
    # The data cursor kept moving through both rollbacks: every sample read once, the spiked ones not again.
    state = read_trainer_state(open_store(f"file://{tmp_path / 'ckpt'}"), steps)
    assert state["data"]["samples_seen"] == sum(r["ft_participants"] for r in run0) * PER_GROUP
    assert state["hooks"]["guards"]["skipped_data"] == [[11, 13], [21, 23]]


def _group_worker(launcher: int, group: int) -> int | None:
    """The training process (torchrun's worker, RANK=0) of replica `group` under `kiln run`."""
    pids, i = [launcher], 0
    while i < len(pids):
        pids += _children(pids[i])
        i += 1
    for pid in pids[1:]:
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"KILN_FT_GROUP={group}".encode() in environ and b"RANK=0" in environ:
            return pid
    return None


def _group_line(log: Path, offset: int, group: int, live: str) -> bool:
    """Whether the `kiln run` log, past `offset`, shows group `group` joining a quorum of `live` groups."""
    return any(f"kiln: ft: group {group}: quorum" in line and f": {live} group(s) live" in line
               for line in log.read_text()[offset:].splitlines())


def test_kiln_run_restarts_a_failed_group_and_it_heals_from_the_live_one(tmp_path):
    """`kiln run` with replica groups: its own lighthouse, a torchrun per group; a group whose worker dies is
    started again at once (a full start: imports and all), and heals from the group that kept training.

    The run's end waits for the restart, whatever it costs here: once the survivor has stepped alone, the test
    freezes it (SIGSTOP) until the restarted group has joined the lighthouse (its `1 of 2` quorum line in the
    log, after its imports), then lets it go on (SIGCONT); the next quorum holds both, and the restarted group
    heals from the survivor. Without the freeze the survivor had to outlast a start (1,000 steps of margin)."""
    steps = 60
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": steps}, checkpoint={"intervalSteps": 1000},
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 2}})
    out, log = tmp_path / "out", tmp_path / "run.log"
    # the survivor's torchft calls in flight while it is frozen must not time out (a start can take a while)
    with log.open("w") as sink:
        launcher = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(spec), "--nproc", "2",
                                     "--output", str(out)],
                                    env=env(KILN_FT_TIMEOUT_SECONDS="600", **die_with_parent()), stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    running = lambda: launcher.poll() is None  # noqa: E731
    context = lambda: log.read_text()[-4000:]  # noqa: E731
    survivor = None
    try:
        wait_until(f"group 1 at step {KILL_AT} with both groups",
                   lambda: [r for r in records(out / "group-1") if r["step"] >= KILL_AT and r["ft_participants"] == 2],
                   alive=running, context=context)
        worker = _group_worker(launcher.pid, 1)
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        killed_at = records(out / "group-1")[-1]["step"]
        wait_until(f"{ALONE} steps of group 0 alone",
                   lambda: len([r for r in records(out / "group-0")
                                if r["step"] > killed_at and r["ft_participants"] == 1]) >= ALONE,
                   alive=running, context=context)
        survivor = _group_worker(launcher.pid, 0)
        os.kill(survivor, signal.SIGSTOP)
        frozen_at, offset = records(out / "group-0")[-1]["step"], len(log.read_text())
        assert frozen_at < steps
        wait_until("the restarted group 1 at the lighthouse", lambda: _group_line(log, offset, 1, "1 of 2"),
                   alive=running, context=context)
        os.kill(survivor, signal.SIGCONT)
        survivor = None
        assert launcher.wait(timeout=SAFETY_TIMEOUT_S) == 0, log.read_text()[-4000:]
    finally:
        if survivor is not None:
            os.kill(survivor, signal.SIGCONT)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    text = log.read_text()
    assert text.count("kiln: replica group 1 failed") == 1 and "kiln: replica group 0 failed" not in text
    g0, g1 = records(out / "group-0"), records(out / "group-1")
    assert [r["step"] for r in g0] == list(range(1, steps + 1))
    healed = [r for r in g1 if r["ft_restore"] == "peer"]
    assert healed and healed[0]["step"] > frozen_at > killed_at and healed[0]["ft_heals"] == 1, \
        g1[killed_at - 1:killed_at + 2]
    # group 1 logged up to the kill, then from the step it healed at: it never trained the steps between
    assert [r["step"] for r in g1] == list(range(1, killed_at + 1)) + list(range(healed[0]["step"], steps + 1))
    assert any(r["ft_participants"] == 1 for r in g0 if killed_at < r["step"] < healed[0]["step"])
    assert g0[-1]["ft_weights_digest"] == g1[-1]["ft_weights_digest"]


def _warm_up_rank(rank: int, world: int, spec_path: str) -> dict:
    """Build a run (2 ranks), take everything warm_up could touch before and after it."""
    import torch

    from kiln.api.load import load_file
    from kiln.trainer.rng import rng_state
    from kiln.trainer.run import setup

    run = setup(load_file(spec_path)[0], output_dir=None, checkpointing=False)
    try:
        def state() -> dict:
            return {"params": {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                               for n, p in run.model.named_parameters()},
                    "optim": repr(run.optimizer.state_dict()), "rng": rng_state(run.device),
                    "cursor": (run.loader.state_dict(), run.last_step, run.tokens_seen)}

        before = state()
        run.warm_up()
        after = state()
        return {"params_equal": all(torch.equal(before["params"][n], t) for n, t in after["params"].items()),
                "optim_equal": before["optim"] == after["optim"],
                "rng_equal": repr(before["rng"]) == repr(after["rng"]),
                "cursor_equal": before["cursor"] == after["cursor"],
                "grads_none": all(p.grad is None for p in run.model.parameters()),
                "marked": "warmed_up" in run.startup}
    finally:
        run.close()


@pytest.mark.parametrize("parallelism", [{"fsdp": True}, {"pipeline": 2}], ids=["fsdp2", "pp2"])
def test_the_warm_up_before_a_join_changes_no_state(tmp_path, parallelism):
    """A replica group runs one forward/backward on a dummy batch before it joins the live groups
    (kiln.trainer.run.Run.warm_up), so that they do not wait for its cold first step. It must leave no trace:
    the same weights, optimizer state, RNG stream and data cursor, no gradient kept; with 2 ranks in FSDP and
    in a 2-stage pipeline (its own forward/backward path). (The heal test above shows the healed group's
    weights and tokens_seen equal to the survivor's afterwards.)"""
    spec = write_spec(tmp_path / "spec.yaml", nproc=2, parallelism=parallelism)
    results = run_ranks(_warm_up_rank, 2, tmp_path, str(spec), init=False)
    for r in results:
        assert r == {"params_equal": True, "optim_equal": True, "rng_equal": True, "cursor_equal": True,
                     "grads_none": True, "marked": True}, results
