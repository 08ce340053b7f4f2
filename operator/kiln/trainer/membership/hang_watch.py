"""A replica group's own hang watch (elastic.faultTolerance replicaGroups): a group whose loop stops making
progress takes itself out, so that it does not hold the others' quorum.

Why here and not in the operator: torchft's ManagerServer heartbeats to the lighthouse from its own (Rust)
thread, so a group whose training loop hangs (a stuck data read, a wedged kernel, a deadlock) still looks live,
and the lighthouse's split-brain rule (a quorum needs more than half of the heartbeating groups) keeps the
others from stepping until their quorum times out (KILN_FT_LIGHTHOUSE_WAIT_SECONDS) and fails: one hung group
would cost the whole job. The operator's hang watch skips replica-group runs (a run-wide restart is what
replica groups avoid), so each group watches itself, with the operator's rule (kiln.api.hang): no
verdict before 5 step times, then a hang when nothing progressed for max(10 x p99 step time, floor).

What counts: the watch is armed only while the group runs its own code (data, forward/backward, clipping,
hooks, optimizer, logging). It is paused (`waiting`) while the group legitimately waits or works long:

- in torchft's calls (quorum, a heal, the gradient and loss allreduce, the commit vote): waiting on the other
  groups or the lighthouse, which torchft bounds itself (KILN_FT_TIMEOUT_SECONDS, the lighthouse wait), and a
  hung peer must not make a live group judge itself hung;
- in a checkpoint save, a guard's rollback (a commit read) and the held-out evaluation;
- before the first step and at start-up (the join, a heal, the first quorum, compile in the first step): the
  first step of a watch gives no step time, and the rule needs 5.

Step times are the armed time between two steps (the paused parts left out), so one long save does not
stretch the limit for the next 20 steps; leaving a pause counts as progress. Time the watch itself did not
run is not counted either (`frozen`): a process stopped (SIGSTOP, a paused VM) or starved of CPU is not a loop
that hangs, and would otherwise take itself out the moment it runs again. The other side of that: a hang that
holds Python's GIL (a C call that never releases it) stops the watch too and is not caught here.

On a verdict: one line on stderr naming the cause, the torchft manager shut down (its heartbeats stop, so the
lighthouse drops the group within its heartbeat timeout and the others' next quorum forms without it), and
the process exits HANG_EXIT_CODE at once (the main thread is stuck: no cleanup can run). torchrun, the pod or
`kiln run` then starts the group again, and it heals from a live peer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

# one place for the rule; imports only kiln.api (no Kubernetes, no kopf)
from kiln.api.hang import HANG_FLOOR_S, hang

HANG_FLOOR_ENV = "KILN_FT_HANG_FLOOR_SECONDS"  # default: the rule's own floor (60 s)
RECENT = 20  # step times the p99 is taken over, as the operator's (kiln.control.elastic_sync)
HANG_EXIT_CODE = 124  # "timed out", as GNU timeout; torchrun reports it as the worker's exit code
SHUTDOWN_WAIT_S = 5.0  # the manager's shutdown may not block the exit behind the stuck main thread


def floor_s(var: str = HANG_FLOOR_ENV, what: str = "a replica group takes itself out") -> float:
    """The rule's floor from `var` (default: the rule's own), seconds without progress before `what`."""
    value = os.environ.get(var, str(HANG_FLOOR_S))
    try:
        floor = float(value)
    except ValueError:
        floor = -1.0
    if not floor > 0:
        from kiln.errors import KilnError

        raise KilnError(f"{var}={value!r}: seconds without progress before {what}, a number > 0")
    return floor


class HangWatch:
    """Progress of one group's loop, and the verdict of the operator's hang rule on it. Pure bookkeeping on a
    clock the caller passes (tests drive it); `start()` runs the check in a daemon thread."""

    def __init__(self, *, floor: float, clock: Callable[[], float] = time.monotonic):
        self.floor, self.clock = floor, clock
        self.recent: deque[float] = deque(maxlen=RECENT)
        self._paused = 0
        self._armed_s = 0.0  # armed time since the last step
        self._since = clock()  # armed since (progress: a step, or the end of a pause)
        self._first = True  # the first step of a watch carries start-up and compile: no step time
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def stepped(self) -> None:
        """A step completed (committed or redone: the loop moved)."""
        with self._lock:
            now = self.clock()
            if not self._first:
                self.recent.append(self._armed_s + (0.0 if self._paused else now - self._since))
            self._first, self._armed_s, self._since = False, 0.0, now

    def frozen(self, seconds: float) -> None:
        """The watch did not run for `seconds` longer than it meant to: the process was stopped or starved."""
        with self._lock:
            if not self._paused:
                self._since = min(self._since + seconds, self.clock())

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A legitimately long or peer-bound phase: no verdict inside it; leaving it is progress."""
        with self._lock:
            if not self._paused:
                self._armed_s += self.clock() - self._since
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if not self._paused:
                    self._since = self.clock()

    def check(self, slept_s: float, period: float) -> str | None:
        """One wake of the watch thread, `slept_s` after its last: the verdict, after leaving out the time a late
        wake says the process did not run."""
        if slept_s > 2 * period:
            self.frozen(slept_s - period)
        return self.verdict()

    def verdict(self) -> str | None:
        """Why this group is hung, or None."""
        with self._lock:
            if self._paused:
                return None
            return hang(list(self.recent), self._since, self.clock(), floor_s=self.floor)  # factor: the rule's, 10

    def start(self, on_hang: Callable[[str], None], every_s: float = 1.0) -> None:
        """Check every `every_s` (or a tenth of the floor, if shorter) in a daemon thread; call on_hang once."""
        period = min(every_s, self.floor / 10)

        def watch() -> None:
            last = self.clock()
            while not self._stop.wait(period):
                now = self.clock()
                why, last = self.check(now - last, period), now
                if why is not None:
                    on_hang(why)
                    return

        threading.Thread(target=watch, name="kiln-ft-hang-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def leave(group: int, why: str, shutdown: Callable[[], None]) -> None:
    """Take a hung group out: say why, stop its heartbeats (shut its torchft manager down), exit at once."""
    reason = why.partition("; ")[0]  # the rule's cause; its action (the operator's restart) is not ours
    print(f"kiln: ft: group {group} hung: {reason}; leaving the quorum (exit {HANG_EXIT_CODE}) so "
          f"that the other groups step on and a restart of this group heals from a live peer", file=sys.stderr,
          flush=True)
    worker = threading.Thread(target=shutdown, daemon=True)
    worker.start()
    worker.join(SHUTDOWN_WAIT_S)  # the exit ends the heartbeat thread anyway; shutting down says goodbye first
    os._exit(HANG_EXIT_CODE)
