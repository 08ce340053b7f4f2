"""Goodput accounting: productive step time / wall time, and the time lost by cause. Pure, no clock.

The operator calls `observe` on every status refresh with the time `now`, the run's phase and what
trainer rank 0 reported (the step, cumulative productive step seconds and checkpoint-stall seconds of
the current trainer process, and the rollbacks so far). The ledger lives in status (`as_status` /
`from_status`), so an operator restart continues the account.

Attribution of the wall time between two observations:
- phase Pending / Scaling with no trainer progress → `pending` (waiting for pods or capacity);
  Restarting → `restart`; Suspended → not counted at all (the user asked for it);
- Running → the trainer's productive-step delta is productive, its checkpoint-stall delta is
  `checkpoint_stall`, and the remainder `other` (start-up, restore, data stalls, logging);
- a step that goes *backwards* (a restart or a rollback resumed from an older commit) re-classifies the
  productive time of the steps done twice: to `rollback` when the trainer's rollback count rose, else
  to `restart`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CAUSES = ("restart", "checkpoint_stall", "rollback", "pending", "other")


@dataclass(frozen=True)
class Report:
    """What trainer rank 0 reported. Times are cumulative within one trainer process (they restart at zero
    with a new process); `start_step` is the committed step that process resumed from."""

    step: int
    productive_s: float  # sum of completed, accepted step times
    checkpoint_stall_s: float = 0.0  # time training was blocked by checkpoint staging/saving
    rollbacks: int = 0  # guard rollbacks so far (kept in the checkpoint, so it does not reset)
    start_step: int = 0


@dataclass(frozen=True)
class Ledger:
    started: float | None = None
    last_seen: float | None = None
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    last: Report | None = None
    max_step: int = 0
    mean_step_s: float = 0.0  # productive seconds per step so far: prices re-done steps

    @property
    def wall_s(self) -> float:
        return self.productive_s + sum(self.lost_s.values())

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_status(self) -> dict:
        return {"goodput": round(self.goodput, 4),
                "goodputDetail": {"wallSeconds": round(self.wall_s, 1), "productiveSeconds": round(self.productive_s, 1),
                                  "lostSeconds": {k: round(v, 1) for k, v in self.lost_s.items()},
                                  "started": self.started, "lastSeen": self.last_seen, "maxStep": self.max_step,
                                  "meanStepSeconds": self.mean_step_s,
                                  "last": None if self.last is None else self.last.__dict__}}

    @classmethod
    def from_status(cls, status: dict | None) -> "Ledger":
        d = (status or {}).get("goodputDetail")
        if not d:
            return cls()
        lost = {c: float(d.get("lostSeconds", {}).get(c, 0.0)) for c in CAUSES}
        return cls(started=d.get("started"), last_seen=d.get("lastSeen"), productive_s=float(d["productiveSeconds"]),
                   lost_s=lost, last=Report(**d["last"]) if d.get("last") else None,
                   max_step=int(d.get("maxStep", 0)), mean_step_s=float(d.get("meanStepSeconds", 0.0)))


def _delta(prev: float, cur: float) -> float:
    """Growth of a cumulative counter; a smaller value means a new trainer process started from zero."""
    return cur - prev if cur >= prev else cur


def observe(ledger: Ledger, now: float, phase: str, report: Report | None = None) -> Ledger:
    """The ledger after attributing the wall time since the last observation."""
    if ledger.last_seen is None:
        return replace(ledger, started=now, last_seen=now, last=report, max_step=report.step if report else 0)
    elapsed = max(0.0, now - ledger.last_seen)
    lost = dict(ledger.lost_s)
    productive, max_step = ledger.productive_s, ledger.max_step

    if phase == "Suspended":
        pass  # the user asked for the pause: neither productive nor lost
    elif phase == "Restarting":
        lost["restart"] += elapsed
    elif report is None or report == ledger.last:  # no new progress report
        lost["pending" if phase in ("Pending", "Scaling") else "other"] += elapsed
    else:
        prev = ledger.last or Report(step=report.step, productive_s=0.0, start_step=report.start_step)
        new_process = report.start_step != prev.start_step or report.productive_s < prev.productive_s
        d_prod = min(report.productive_s - (0.0 if new_process else prev.productive_s), elapsed)
        d_stall = report.checkpoint_stall_s - (0.0 if new_process else prev.checkpoint_stall_s)
        d_stall = min(max(0.0, d_stall), elapsed - d_prod)
        productive += max(0.0, d_prod)
        lost["checkpoint_stall"] += d_stall
        lost["other"] += elapsed - max(0.0, d_prod) - d_stall
        # Steps done again after resuming from an older commit were not progress after all.
        resumed_at = report.start_step if new_process else report.step
        redone = max(0, prev.step - resumed_at) * (ledger.mean_step_s if ledger.max_step else 0.0)
        redone = min(redone, productive)
        productive -= redone
        lost["rollback" if report.rollbacks > prev.rollbacks else "restart"] += redone
        max_step = max(max_step, report.step)
    mean = productive / max_step if max_step else 0.0
    return replace(ledger, last_seen=now, productive_s=productive, lost_s=lost,
                   last=report if report is not None else ledger.last, max_step=max_step, mean_step_s=mean)
