"""elastic.faultTolerance replicaGroups with real processes: a torchft lighthouse and 2 replica groups, each its
own torchrun job (1 gloo rank), kill one group at a step it reports, the other keeps stepping, the killed
group comes back and heals from its live peer (no checkpoint read), both end with the same weights.

The groups run `kiln train` through tests/distributed/ft_group_entry.py, which holds each worker at a gate
after its imports; the test releases a group when the run reports a given step, never after a delay.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.control.plan import TORCHRUN_ENV
from tests.distributed.ranks import SAFETY_TIMEOUT_S, _children, complete_lines, wait_until
from tests.distributed.trainer_helpers import env, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ENTRY = Path(__file__).resolve().parent / "ft_group_entry.py"
STEPS = 500  # room for the returning group: it needs a few seconds of the survivor's steps
KILL_AT = 10  # group 1 is killed once it reports this step with both groups in the quorum
ALONE = 5  # group 0 must report this many steps alone before group 1 comes back
PER_GROUP, SEQ = 2, 32  # globalBatchSize 4 over 2 groups; the micro model's seqLen


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in complete_lines(out / "metrics.jsonl") if line.strip()]


class Group:
    """One replica group: torchrun --standalone with one worker, held at its gate until released."""

    def __init__(self, index: int, spec: Path, out: Path, lighthouse: str, tmp: Path, name: str):
        self.index, self.out, self.name = index, out, name
        self.gate = tmp / f"gate-{name}"
        os.mkfifo(self.gate)
        self.log_path = tmp / f"{name}.log"
        self._log = self.log_path.open("w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(ENTRY),
               "--config", str(spec), "--output", str(out)]
        self.proc = subprocess.Popen(
            cmd, env=env(KILN_FT_LIGHTHOUSE=lighthouse, KILN_FT_GROUP=str(index), KILN_TEST_GATE=str(self.gate),
                         TORCHFT_TIMEOUT_SEC="30", **TORCHRUN_ENV),
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def _open_gate(self):
        try:  # succeeds once the worker has opened its end: it is imported and waiting
            return os.open(self.gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as err:
            if err.errno == errno.ENXIO:
                return None
            raise

    def ready(self) -> int:
        return wait_until(f"{self.name} at its gate", self._open_gate, alive=self.alive, context=self.log)

    @staticmethod
    def release(*groups: "Group") -> None:
        """Once every one is imported and waiting, let them all go at once."""
        fds = [g.ready() for g in groups]
        for fd in fds:
            os.write(fd, b"go")
            os.close(fd)

    def _tree(self) -> list[int]:  # torchrun and its workers (which torchrun starts in sessions of their own)
        pids, i = [self.proc.pid], 0
        while i < len(pids):
            pids += _children(pids[i])
            i += 1
        return pids

    def kill(self) -> None:  # the whole group at once, as when its pod is lost
        for pid in self._tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=SAFETY_TIMEOUT_S)
        finally:
            self._log.close()

    def stop(self) -> None:
        if self.alive():
            self.kill()
        self._log.close()


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


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
        g0, g1, g1b = (Group(0, spec, tmp_path / "ft" / "g0", lighthouse, tmp_path, "g0"),
                       Group(1, spec, tmp_path / "ft" / "g1", lighthouse, tmp_path, "g1"),
                       Group(1, spec, tmp_path / "ft" / "g1b", lighthouse, tmp_path, "g1b"))
        groups += [g0, g1, g1b]
        Group.release(g0, g1)
        both = wait_until(f"group 1 at step {KILL_AT} with both groups in the quorum",
                          lambda: [r for r in records(g1.out) if r["step"] >= KILL_AT and r["ft_participants"] == 2],
                          alive=g1.alive, context=g1.log)
        g1.kill()
        killed_at = records(g1.out)[-1]["step"]
        assert killed_at >= both[0]["step"]

        # Group 0 keeps stepping alone while group 1 is down.
        alone = wait_until(f"{ALONE} steps of group 0 alone",
                           lambda: len(a := [r for r in records(g0.out)
                                             if r["step"] > killed_at and r["ft_participants"] == 1]) >= ALONE and a,
                           alive=g0.alive, context=g0.log)
        assert not g1.alive()
        assert not list((tmp_path / "ft" / "ckpt").glob("step-*")), "no commit exists before the final step"

        Group.release(g1b)  # group 1 comes back
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
    # Only one group wrote the final commit, and it holds the last step.
    assert (tmp_path / "ft" / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:08d}"

    # The held-out loss ends close to the fault-free run's (the degraded steps averaged half the batch; the
    # last training batch itself differs, as the cursor moved less).
    final, want = run0[-1]["val_loss"], ref0[-1]["val_loss"]
    print(f"ft: killed at step {killed_at}, {len(degraded)} step(s) alone ({degraded[0]}..{degraded[-1]}), "
          f"group 1 back at step {first['step']}; validation loss {final:.5f} vs fault-free {want:.5f} "
          f"({(final - want) / want:+.3%})")
    assert final == pytest.approx(want, rel=0.05)
