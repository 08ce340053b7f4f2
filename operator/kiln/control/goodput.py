"""Goodput accounting: productive step time / the run's wall time since creation, and the time lost by cause.

Pure, no clock. The operator calls `observe` on every status refresh with the time `now`, the phase that
held since the previous observation (the status' phase before this refresh) and the cumulative counters
trainer rank 0 reports in `status.trainerTime` (productive, checkpoint-stall and rollback seconds, carried
in the checkpoint across restarts). The ledger lives in `status.goodputDetail` (`as_status` /
`from_status`), so an operator restart continues the account.

Attribution of the wall time between two observations:
- the growth of the trainer's counters (what was not credited yet) is productive, `checkpointStall`,
  `rollback`, `preflight` (the pre-flight check before step 1: kiln.trainer.observe.preflight) — each at most the time left in the interval, so no time is ever invented; the rest carries
  over to the next interval;
- with replica groups, the part of the productive time the job stepped with fewer than all groups live
  (trainerTime.degradedSeconds: degraded, still stepping) is `degradedSeconds`, inside the productive time
  and apart from the lost (stopped) time; the time every group was stopped is `restart` as without groups;
- the remainder goes to what held (`held(status)`): Pending / Queued / Scaling → `pending`, Queued after Kueue
  preempted the run (condition Queued, reason Preempted) → `preempted`, Restarting → `restart`, Suspended →
  `suspended`, moving off a node whose GPUs degrade or fail (condition GPUHealthy, reason MovingOffNode, from
  the commit request until the trainer reports from the new nodes: kiln.control.failover) → `gpuFailover`,
  Running → counted as wall time only (start-up, restore, data waits, logging);
- a productive counter that went *down* means a new trainer resumed from an older commit: that much
  productive time is moved to `restart` (it is done again);
- after Succeeded / Failed nothing more is counted.

GPU-seconds (`gpuSeconds` in the ledger, `status.cost` in GPU-hours and money): each interval's seconds, split as
above, times the GPUs the run held during it (`gpus_held`: nodes × gpusPerNode while its pods hold their GPUs —
Running, Restarting, Scaling, moving off a failing node — and none while Pending, Queued, preempted or
Suspended, when no pod of it is bound to a GPU). The wall time the run held GPUs without stepping, checkpointing
or rolling back (start-up, restore, data waits) is `other`. The causes add up to the total by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from kiln.control.failover import MOVING

CAUSES = ("pending", "restart", "checkpointStall", "rollback", "suspended", "preempted", "gpuFailover", "preflight")
PREEMPTED = "Preempted"  # Kueue's eviction reason, kiln's condition Queued reason (kiln.control.kueue)
COUNTERS = ("productiveSeconds", "checkpointStallSeconds", "rollbackSeconds", "preflightSeconds")  # trainerTime
DEGRADED = "degradedSeconds"  # status.trainerTime: productive seconds stepped with fewer than all replica groups
REMAINDER = {"Pending": "pending", "Queued": "pending", "Scaling": "pending", "Restarting": "restart",
             "Suspended": "suspended", PREEMPTED: "preempted", MOVING: "gpuFailover"}
FINAL = ("Succeeded", "Failed")
GPU_CAUSES = ("productive", *CAUSES, "other")  # status.goodputDetail.gpuSeconds and status.cost.gpuHoursByCause
HOLDS_GPUS = frozenset({"Running", "Restarting", "Scaling", MOVING})  # held(status) values whose pods hold GPUs


def gpus_held(status: dict | None, gpus_per_node: int) -> int:
    """The GPUs the run held while `status` held: its nodes' GPUs when its pods hold them, else none."""
    s = status or {}
    return int(s.get("nodes") or 0) * gpus_per_node if held(s) in HOLDS_GPUS else 0


def held(status: dict | None) -> str | None:
    """What held since the status was written: its phase, or PREEMPTED while the run waits Queued because
    Kueue preempted it (Kueue keeps its Workload's Evicted/Preempted condition until it admits it again)."""
    s = status or {}
    queued = next((c for c in s.get("conditions") or [] if c.get("type") == "Queued"), {})
    if s.get("phase") == "Queued" and queued.get("status") == "True" and queued.get("reason") == PREEMPTED:
        return PREEMPTED
    if s.get("phase") not in FINAL and any(c.get("type") == "GPUHealthy" and c.get("reason") == MOVING
                                           for c in s.get("conditions") or []):
        return MOVING  # moving off a node with failing GPUs (kiln.control.failover): until it reports elsewhere
    return s.get("phase")


@dataclass(frozen=True)
class Ledger:
    observed_at: float  # epoch seconds accounted up to (the run's creation at first)
    wall_s: float = 0.0
    productive_s: float = 0.0
    degraded_s: float = 0.0  # of productive_s: stepping with fewer than all replica groups live
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    credited: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*COUNTERS, DEGRADED), 0.0))  # taken
    gpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GPU_CAUSES, 0.0))  # GPU-seconds by cause

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_status(self) -> dict:
        return {"goodput": round(min(1.0, self.goodput), 4),
                "goodputDetail": {"observedAt": rfc3339(self.observed_at), "wallSeconds": round(self.wall_s, 1),
                                  "productiveSeconds": round(self.productive_s, 1),
                                  DEGRADED: round(self.degraded_s, 1),
                                  "lostSeconds": {k: round(v, 1) for k, v in self.lost_s.items()},
                                  "gpuSeconds": {k: round(v, 1) for k, v in self.gpu_s.items()},
                                  "credited": dict(self.credited)}}

    @classmethod
    def from_status(cls, status: dict | None, created: float) -> Ledger:
        """The ledger kept in status, or a fresh one starting at the run's creation."""
        d = (status or {}).get("goodputDetail") or {}
        if not d.get("observedAt"):
            return cls(observed_at=created)
        return cls(observed_at=epoch(d["observedAt"]), wall_s=float(d.get("wallSeconds", 0.0)),
                   productive_s=float(d.get("productiveSeconds", 0.0)), degraded_s=float(d.get(DEGRADED, 0.0)),
                   lost_s={c: float((d.get("lostSeconds") or {}).get(c, 0.0)) for c in CAUSES},
                   credited={c: float((d.get("credited") or {}).get(c, 0.0)) for c in (*COUNTERS, DEGRADED)},
                   gpu_s={c: float((d.get("gpuSeconds") or {}).get(c, 0.0)) for c in GPU_CAUSES})


def counters(status: dict | None) -> dict[str, float]:
    """The trainer's cumulative counters from status.trainerTime (zero where not reported yet)."""
    reported = (status or {}).get("trainerTime") or {}
    found = {c: max(0.0, float(reported.get(c) or 0.0)) for c in COUNTERS}
    if DEGRADED in reported:  # replica groups only
        found[DEGRADED] = max(0.0, float(reported[DEGRADED] or 0.0))
    return found


def observe(ledger: Ledger, now: float, phase: str | None, reported: dict[str, float], gpus: int = 0) -> Ledger:
    """The ledger after attributing the wall time since the last observation to `phase` (the phase that held),
    and its GPU-seconds at `gpus` held during that time."""
    if phase in FINAL or now <= ledger.observed_at:
        return ledger
    elapsed = now - ledger.observed_at
    lost, credited, productive = dict(ledger.lost_s), dict(ledger.credited), ledger.productive_s
    gpu_s = dict(ledger.gpu_s)
    if reported["productiveSeconds"] < credited["productiveSeconds"]:  # resumed from an older commit
        redone = min(credited["productiveSeconds"] - reported["productiveSeconds"], productive)
        moved = gpu_s["productive"] * redone / productive if productive > 0 else 0.0  # at the GPUs it ran on
        gpu_s["productive"] -= moved
        gpu_s["restart"] += moved
        productive -= redone
        lost["restart"] += redone
    left, degraded, stepped = elapsed, ledger.degraded_s, 0.0
    for counter, cause in zip(COUNTERS, (None, "checkpointStall", "rollback", "preflight")):
        value = reported.get(counter, 0.0)  # preflightSeconds: absent from older trainers' reports
        if value < credited[counter]:
            credited[counter] = value  # a new trainer process: its counters are the new baseline
        take = min(value - credited[counter], left)
        credited[counter] += take
        left -= take
        gpu_s[cause or "productive"] += take * gpus
        if cause is None:
            productive += take
            stepped = take
        else:
            lost[cause] += take
    # the degraded part of the productive time just credited (never more than it: no time is invented)
    reported_degraded = reported.get(DEGRADED, 0.0)
    if reported_degraded < credited[DEGRADED]:
        credited[DEGRADED] = reported_degraded  # a new trainer process: the new baseline
    take = min(reported_degraded - credited[DEGRADED], stepped)
    credited[DEGRADED] += take
    degraded = min(degraded + take, productive)
    if phase is not None and phase in REMAINDER:
        lost[REMAINDER[phase]] += left
        gpu_s[REMAINDER[phase]] += left * gpus
    elif phase is None:
        lost["pending"] += left  # before the operator's first status: nothing was running yet
    else:
        gpu_s["other"] += left * gpus  # held while running, not stepping: start-up, restore, data waits
    return replace(ledger, observed_at=now, wall_s=ledger.wall_s + elapsed, productive_s=productive,
                   degraded_s=degraded, lost_s=lost, credited=credited, gpu_s=gpu_s)


def cost(ledger: Ledger, price_per_gpu_hour: float | None, currency: str) -> dict:
    """status.cost: the GPU-hours the run held, by cause (they add up to the total), and their price when the
    platform set one for the run's GPU type."""
    by_cause = {c: round(v / 3600, 4) for c, v in ledger.gpu_s.items()}
    out: dict = {"gpuHours": round(sum(ledger.gpu_s.values()) / 3600, 4), "gpuHoursByCause": by_cause}
    if price_per_gpu_hour is not None:
        out.update(pricePerGpuHour=price_per_gpu_hour, currency=currency,
                   amount=round(sum(ledger.gpu_s.values()) / 3600 * price_per_gpu_hour, 2),
                   amountByCause={c: round(v / 3600 * price_per_gpu_hour, 2) for c, v in ledger.gpu_s.items()})
    return out


def settled(old: dict | None, update: dict, now: float, created: float, *, gpus_per_node: int = 0,
            price_per_gpu_hour: float | None = None, currency: str = "USD") -> dict:
    """`update` (a status patch) with the ledger (and status.cost) observed up to `now` when the patch changes
    what held.

    The ledger prices each interval by what held during it, at the next write; a write that ends a state
    (a GPU move's MovingOffNode cleared by the tick) must price the interval it ends first, or the next
    refresh would charge it to what holds then."""
    if held(old) == held({**(old or {}), **update}):
        return update
    ledger = observe(Ledger.from_status(old, created), now, held(old), counters(old), gpus_held(old, gpus_per_node))
    return {**update, **ledger.as_status(), "cost": cost(ledger, price_per_gpu_hour, currency)}


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
