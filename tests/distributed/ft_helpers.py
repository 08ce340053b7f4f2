"""Replica groups of `kiln train` for the fault-tolerance tests and benchmark: each its own torchrun job
(`--standalone`, `nproc` workers: the group's own world), held at a gate after its imports until released.

The worker is tests/distributed/ft_group_entry.py: it imports torch, torchft and the trainer, then opens the
FIFO named by KILN_TEST_GATE and blocks. `Group.release` waits until every named group's workers have opened
its end (they are ready), then lets them all go at once; a restarted group then rejoins within a second or so.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import urllib.request
import subprocess
import sys
from pathlib import Path

from kiln.api import contract
from kiln.control.plan import TORCHRUN_ENV
from tests.support.ranks import SAFETY_TIMEOUT_S, _children, complete_lines, wait_until
from tests.support.runs import env

ENTRY = Path(__file__).resolve().parent / "ft_group_entry.py"
PDEATHSIG = Path(__file__).resolve().parent / "pdeathsig"  # its sitecustomize.py


def die_with_parent() -> dict[str, str]:
    """Environment for a process tree that dies with the test: every Python process in it gets SIGKILL when
    its parent dies (tests/distributed/pdeathsig/sitecustomize.py), so a killed pytest orphans nothing."""
    path = os.pathsep.join(p for p in (str(PDEATHSIG), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "KILN_TEST_PDEATHSIG": "1"}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in complete_lines(out / "metrics.jsonl") if line.strip()]


class Group:
    """One replica group: torchrun --standalone with `nproc` workers, held at its gate until released
    (gated=False: plain `kiln train`, which starts at once, as a restarted pod does)."""

    def __init__(self, index: int, spec: Path, out: Path, lighthouse: str, tmp: Path, name: str,
                 gated: bool = True, extra_env: dict[str, str] | None = None, nproc: int = 1):
        self.index, self.out, self.name, self.nproc = index, out, name, nproc
        # one FIFO per worker (ft_group_entry: rank 0 opens the first, local rank r the r-th): one writer's
        # "go" on a shared FIFO could reach the first reader only, leaving a later one blocked
        self.gate = tmp / f"gate-{name}"
        self._gates = [self.gate, *(Path(f"{self.gate}.{r}") for r in range(1, nproc))]
        self._fds: dict[Path, int] = {}  # the gates whose worker is waiting, held open until the release
        if gated:
            for gate in self._gates:
                os.mkfifo(gate)
        self.log_path = tmp / f"{name}.log"
        self._log = self.log_path.open("w")
        entry = [str(ENTRY)] if gated else ["-m", "kiln.cli.main", "train"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry,
               "--config", str(spec), "--output", str(out)]
        group_env = {"KILN_FT_LIGHTHOUSE": lighthouse, "KILN_FT_GROUP": str(index), "KILN_TEST_GATE": str(self.gate),
                     "TORCHFT_TIMEOUT_SEC": "30", **TORCHRUN_ENV, **die_with_parent(), **(extra_env or {})}
        self.proc = subprocess.Popen(
            cmd, env=env(**group_env),
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def _open_gates(self) -> bool:
        """Whether every worker is imported and waiting: a gate opens for writing once its worker has opened its
        end. An opened gate stays open until the release (closing it would let its worker go)."""
        for gate in self._gates:
            if gate in self._fds:
                continue
            try:
                self._fds[gate] = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                if err.errno == errno.ENXIO:
                    return False
                raise
        return True

    def ready(self) -> None:
        wait_until(f"{self.name} at its gate", self._open_gates, alive=self.alive, context=self.log)

    def _go(self) -> None:
        for fd in self._fds.values():
            os.write(fd, b"go")
            os.close(fd)
        self._fds.clear()

    def release_if_ready(self) -> bool:
        """Let it go if its workers wait at their gates now; False (nothing done) while one is still importing."""
        if not self._open_gates():
            return False
        self._go()
        return True

    @staticmethod
    def release(*groups: "Group") -> None:
        """Once every one is imported and waiting, let them all go at once."""
        for g in groups:
            g.ready()
        for g in groups:
            g._go()

    def _tree(self) -> list[int]:  # torchrun and its workers (which torchrun starts in sessions of their own)
        pids, i = [self.proc.pid], 0
        while i < len(pids):
            pids += _children(pids[i])
            i += 1
        return pids

    def signal(self, sig: int) -> None:
        """`sig` to torchrun and its workers (SIGSTOP/SIGCONT: freeze the group and let it go on)."""
        for pid in self._tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

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
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._log.close()


def kill_and_bring_back(survivor: Group, victim: Group, replacement: Group, *, kill_at: int, alone: int,
                        ckpt: Path) -> tuple[int, list[dict], int]:
    """The fault of the heal tests, driven by the steps the run reports: `victim` (torchrun and its workers) is
    killed once it reports step `kill_at` with both groups in the quorum; `survivor` then steps `alone` steps
    without it; with no commit in `ckpt` to read, `replacement` (held at its gates) is released while the
    survivor is frozen (SIGSTOP) until the replacement is at the lighthouse (its quorum line, alone), so that
    neither the rest of its start nor the machine's speed decides whether it is back before the end. Returns
    the step the victim reported last, the survivor's records alone, and the step it was frozen at."""
    both = wait_until(f"{victim.name} at step {kill_at} with both groups in the quorum",
                      lambda: [r for r in records(victim.out) if r["step"] >= kill_at and r["ft_participants"] == 2],
                      alive=victim.alive, context=victim.log)
    victim.kill()
    killed_at = records(victim.out)[-1]["step"]
    assert killed_at >= both[0]["step"]
    steps_alone = wait_until(f"{alone} steps of {survivor.name} alone",
                             lambda: len(a := [r for r in records(survivor.out)
                                               if r["step"] > killed_at and r["ft_participants"] == 1]) >= alone and a,
                             alive=survivor.alive, context=survivor.log)
    return killed_at, steps_alone, bring_back(survivor, replacement, ckpt=ckpt)


def bring_back(survivor: Group, replacement: Group, *, ckpt: Path | None = None) -> int:
    """Release `replacement` (held at its gates) while `survivor` is frozen (SIGSTOP) until the replacement is at
    the lighthouse (its quorum line, alone), so that neither the rest of its start nor the machine's speed
    decides whether it is back before the survivor's end; with `ckpt`, no commit may exist there to read.
    Returns the step the survivor was frozen at."""
    survivor.signal(signal.SIGSTOP)
    try:
        frozen_at = records(survivor.out)[-1]["step"]
        assert ckpt is None or not list(ckpt.glob("step-*")), "no commit exists to read"
        Group.release(replacement)
        wait_until(f"{replacement.name} back at the lighthouse",
                   lambda: f"kiln: ft: group {replacement.index}: quorum" in replacement.log_path.read_text(),
                   alive=replacement.alive, context=replacement.log)
    finally:
        survivor.signal(signal.SIGCONT)
    return frozen_at


def heartbeating(lighthouse: str) -> int:
    """How many groups the lighthouse counts as live now (its /status page: `[N heartbeating]`). A group that
    was killed stays in the next quorum, with its last step, until its heartbeat is old: a group that joins
    before then is told to heal from the dead one and waits out torchft's store timeouts (2 × 60 s)."""
    page = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    match = re.search(r"\[(\d+) heartbeating\]", page)
    assert match, f"no heartbeat count on the lighthouse's status page:\n{page[:2000]}"
    return int(match[1])


def lighthouse_server(join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1000):
    """torchft's lighthouse in this process (min 1 replica: one live group keeps training)."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms, quorum_tick_ms=contract.FT_QUORUM_TICK_MS)
