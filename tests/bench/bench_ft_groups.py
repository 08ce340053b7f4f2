"""Fault-injection benchmark in replica-group mode (elastic.faultTolerance replicaGroups, torchft).

Two jobs run side by side, on the same cores at the same time, so the machine's load falls on both alike:
the *reference* (no faults) and the *faulty* one. Each is a torchft lighthouse and 2 replica groups, each
group `kiln train` under its own torchrun (1 gloo worker, the micro Llama), with periodic commits to S3 (the
rig's versitygw when the rig is up, else a private one) by the replica-rank-0 group. In the faulty job, every
--kill-every steps the job reports, the watcher SIGKILLs one whole group (groups in turn: group 0 is the
commit writer at first) and starts it again at once, as Kubernetes restarts a lost pod: a fresh torchrun
that imports, builds the model and heals from the live peer. The next kill waits until that group is back.
Kills follow the run's reported steps, never a clock.

The job's timeline is the time each step was first reported by any group. Reported:
  gaps             the time between consecutive steps of the job: p50/p90/p99/max, both jobs (the
                   reference's distribution is what the machine's load alone does to a step)
  kills[]          per kill: step, group, `kill_gap_s` (the job's gap across the kill: the failed step,
                   the lighthouse dropping the dead group, the redone step), `back_s` (kill → the group's
                   first step again), `heal_s` (the returning process's join: quorum + receiving a live
                   peer's state, from its startup marks; its warm-up before the join, `warm_up_s`, apart),
                   `heal_gap_s` (the job's gap at the step the group
                   came back at: what the survivor waited for the heal), restore (peer | checkpoint)
  goodput          1 − lost / wall, lost = Σ (gap − reference p50) over the gaps holding a kill or a heal:
                   steps the survivors took alone count as work (they are committed steps)
  goodput_p99      the same with every gap above the reference's p99 counted as lost (faults or load)
  guard_events     every new step the guards skipped or rolled back, both jobs, with the job's 70 steps before
                   it (step, loss, live groups): whether a verdict came from a real spike
  kiln_ledger      kiln's own account (kiln.control.goodput over the trainer's counters in the final
                   commit's trainer.json): productive, degraded seconds and goodput over the same wall,
                   against the benchmark's degraded time (Σ gaps ending in a step with one group live)
  cost_per_fault   what a fault cost (tests/bench/fault_cost.py): kiln_ledger's timeline (Running over the
                   job's wall, the final counters) priced by status.cost at 2 devices (one per group) in each
                   job's kiln_ledger.cost (GPU-hours by cause, their amount at --price-per-gpu-hour), the
                   faulty job's less the reference's, per kill. The run stays Running while a group is away,
                   so the ledger puts the time lost to a fault in `other` (held, not stepping), the steps taken
                   alone in productive
  val_loss_diff    faulty − reference held-out loss at the end (the faulty job trained fewer samples:
                   a step with one group live averages half the batch); `sample_share` = tokens trained /
                   the reference's

    python -m tests.bench.bench_ft_groups [--steps 6000] [--kill-every 200] [--heartbeat-ms 1000] [--cold]
                                          [--out runs/bench/ft_groups.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path

from tests.bench.fault_cost import add_price_args, ledger, per_fault, priced
from tests.bench.report import write_report
from tests.distributed.ft_helpers import Group, lighthouse_server
from tests.support.ranks import POLL_S, SAFETY_TIMEOUT_S
from tests.support.runs import write_spec

GROUPS = 2
GUARD_CONTEXT = 70  # records kept before a guard's skip or rollback (its window is 64 losses)


def spec(path: Path, steps: int, interval: int, uri: str, endpoint: str | None) -> Path:
    checkpoint = {"uri": uri, "intervalSteps": interval, "keep": 2, **({"endpoint": endpoint} if endpoint else {})}
    return write_spec(path, training={"steps": steps, "seed": 1, "logEvery": 1}, checkpoint=checkpoint,
                      resources={"processesPerNode": GROUPS},
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": GROUPS}})


class _Tail:
    """New complete lines of a group's metrics.jsonl."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, ""
        self.count = 0  # records read so far

    def new(self) -> list[dict]:
        try:
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = [json.loads(line) for line in lines if line.strip()]
        self.count += len(out)
        return out


def _quantiles(values: list[float]) -> dict:
    s = sorted(values)
    if not s:
        return {}
    q = lambda p: s[min(len(s) - 1, int(len(s) * p))]  # noqa: E731
    return {"n": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1], "mean": sum(s) / len(s)}


class Job:
    """One job (lighthouse + groups) and its watcher: the timeline of first reports, and the kills."""

    def __init__(self, name: str, tmp: Path, run_spec: Path, lighthouse: str, logs: Path, steps: int,
                 kill_every: int, warm: bool):
        self.name, self.tmp, self.spec, self.lighthouse, self.logs = name, tmp, run_spec, lighthouse, logs
        self.steps, self.kill_every = steps, kill_every
        self.live = {i: self._start(i, 0) for i in range(GROUPS)}
        self.everyone = [g for g, _ in self.live.values()]
        # warm: each group's replacement is started ahead, held at its gate after its imports (a standby pod)
        self.spares = {i: self._start(i, 1, gated=True) for i in range(GROUPS)} if warm and kill_every else {}
        self.everyone += [g for g, _ in self.spares.values()]
        self.warm = warm
        self.first_seen: dict[int, float] = {}
        self.participants: dict[int, int] = {}
        self.quorum_s: dict[tuple[int, int], float | None] = {}  # (group, step) → that step's quorum time
        self.step_s: dict[int, float] = {}  # the trainer's own step time (what its ledger counts productive)
        self.last: dict[int, dict] = {}
        self.redone: dict[str, int] = {}
        self.kills: list[dict] = []
        self.pending: dict | None = None
        self.next_kill, self.victim = kill_every, 0
        self.late: list[str] = []  # replacements stopped unheard: the job had ended before they were back
        self.recent: deque[list] = deque(maxlen=GUARD_CONTEXT)  # the job's last (step, loss, live groups)
        self.guard_events: list[dict] = []  # every skipped step and rollback, with the losses before it

    def _start(self, index: int, n: int, gated: bool = False) -> tuple[Group, _Tail]:
        out = self.tmp / self.name / f"g{index}-{n}"
        return (Group(index, self.spec, out, self.lighthouse, self.logs, f"{self.name}-g{index}-{n}", gated=gated),
                _Tail(out / "metrics.jsonl"))

    def running(self) -> bool:
        return any(g.alive() for g, _ in self.live.values())

    def poll(self, now: float) -> None:
        for index, (group, tail) in self.live.items():
            for r in tail.new():
                if r["step"] not in self.first_seen:
                    self.first_seen[r["step"]] = now
                    self.participants[r["step"]] = r.get("ft_participants", GROUPS)
                    self.step_s[r["step"]] = r["step_s"]
                    if r.get("guard_action") not in (None, "ok"):  # every group of the quorum says the same
                        self.guard_events.append({
                            "step": r["step"], "action": r["guard_action"], "reason": r.get("guard_reason"),
                            "rolled_back_to": r.get("rolled_back_to"), "participants": r.get("ft_participants"),
                            "zscore": r.get("guard_loss_zscore"), "before": list(self.recent)})
                    self.recent.append([r["step"], round(r["loss"], 4), r.get("ft_participants")])
                self.last[index] = r
                self.redone[group.name] = r.get("ft_redone_steps", 0)  # counted per process
                self.quorum_s[index, r["step"]] = r.get("ft_quorum_s")
                p = self.pending
                if p is not None and index == p["group"] and "back_at_step" not in p:
                    startup = r.get("startup") or {}
                    joining = startup.get("joining", startup.get("model_built"))  # after its warm-up
                    p.update(back_at_step=r["step"], back_s=now - p["at_s"], restore=r.get("ft_restore"),
                             heal_s=(startup["restored"] - joining) if startup else None,
                             warm_up_s=(startup["warmed_up"] - startup["model_built"])
                             if "warmed_up" in startup else None,
                             join_quorum_s=r.get("ft_quorum_s"), heal_load_s=r.get("ft_heal_load_s"),
                             first_step_s=r["step_s"])
        job_step = max(self.first_seen, default=0)
        if self.pending is not None and "back_at_step" in self.pending:
            self.pending = None
        if job_step >= self.steps:  # the last step is in: a replacement not back yet has no peer left to heal
            for group, tail in self.live.values():  # from (it would wait START_WAIT, then read the final commit)
                if group.alive() and tail.count == 0:
                    group.stop()
                    self.late.append(group.name)
        if self.kill_every and self.pending is None and self.next_kill <= job_step < self.steps \
                and self.next_kill < self.steps - self.kill_every // 2:
            group, _ = self.live[self.victim]
            if group.alive():
                # released only for a live victim: a standby let go with no group to replace ran untracked
                spare = self.spares.get(self.victim)
                if self.warm and not (spare and spare[0].release_if_ready()):
                    return  # its standby is still importing: the kill waits for it (an event, not a delay)
                group.kill()
                self.pending = {"group": self.victim, "at_step": job_step, "at_s": now}
                self.kills.append(self.pending)
                n = len([k for k in self.kills if k["group"] == self.victim])
                if self.warm:  # the released standby replaces it; the next standby starts importing now
                    self.live[self.victim] = spare
                    self.spares[self.victim] = self._start(self.victim, n + 1, gated=True)
                    self.everyone.append(self.spares[self.victim][0])
                else:  # a cold start, as when the pod is made again
                    self.live[self.victim] = self._start(self.victim, n)
                    self.everyone.append(self.live[self.victim][0])
                self.victim = (self.victim + 1) % GROUPS
            self.next_kill = job_step + self.kill_every

    def stop(self) -> None:
        for g in self.everyone:
            g.stop()

    def summary(self, ref_gap: dict | None) -> dict:
        order = sorted(self.first_seen)
        seen = [self.first_seen[s] for s in order]
        gaps = {b: self.first_seen[b] - self.first_seen[a] for a, b in zip(order, order[1:])}  # gap ending at b
        wall = seen[-1] - seen[0] if seen else 0.0
        finals = [r for r in self.last.values() if r["step"] == self.steps]
        out = {
            "rcs": [g.proc.returncode for g, _ in self.live.values()],
            "late_replacements_stopped": self.late,
            "wall_s": wall, "final_step": order[-1] if order else 0, "gaps": _quantiles(list(gaps.values())),
            "final_val_loss": finals[0].get("val_loss") if finals else None,
            "final_weights_digests": sorted({r.get("ft_weights_digest") for r in finals}),
            "final_tokens_seen": finals[0]["tokens_seen"] if finals else None,
            # the job's guard counters (a healed group receives them): spikes skipped, rollbacks
            "guard": {k: finals[0].get(k) for k in ("guard_skipped_spike", "guard_skipped_nonfinite",
                                                     "guard_rollbacks")} if finals else None,
            "guard_events": self.guard_events,
            "redone_steps": sum(self.redone.values()),  # steps voted down (a group died in them), every process
            "degraded_s": sum(g for b, g in gaps.items() if self.participants[b] < GROUPS),
            "steps_degraded": sum(1 for s in order if self.participants[s] < GROUPS),
            "step_s": _quantiles(list(self.step_s.values())),
            "sum_step_s": sum(self.step_s[s] for s in order[1:]),
        }
        if not self.kills or ref_gap is None:
            return out
        for k in self.kills:
            after = [s for s in order if s > k["at_step"]]
            survivor = (k["group"] + 1) % GROUPS
            k["kill_gap_s"] = gaps.get(after[0]) if after else None
            k["survivor_quorum_after_kill_s"] = self.quorum_s.get((survivor, after[0])) if after else None
            if "back_at_step" in k:
                k["heal_gap_s"] = gaps.get(k["back_at_step"])
                k["survivor_quorum_at_heal_s"] = self.quorum_s.get((survivor, k["back_at_step"]))
                k["steps_alone"] = sum(1 for s in order if k["at_step"] < s < k["back_at_step"])
        fault_gaps = [g for k in self.kills for g in (k.get("kill_gap_s"), k.get("heal_gap_s")) if g is not None]
        lost = sum(max(0.0, g - ref_gap["p50"]) for g in fault_gaps)
        lost_p99 = sum(g - ref_gap["p99"] for g in gaps.values() if g > ref_gap["p99"])
        out.update(kills=self.kills, lost_s=lost, goodput=1 - lost / wall if wall else None,
                   goodput_p99=1 - lost_p99 / wall if wall else None)
        return out


def kiln_ledger(uri: str, endpoint: str | None, wall_s: float, price: tuple[float, str]) -> dict:
    """kiln's own goodput ledger (kiln.control.goodput) over the trainer's counters in the final commit, and what
    it cost (status.cost) at `price` (per GPU-hour, currency) with a device per group."""
    from kiln.storage.commit import read_latest, read_trainer_state
    from kiln.storage.store import open_store
    from kiln.trainer.observe.status_report import DEGRADED, TRAINER_TIME

    store = open_store(uri, endpoint=endpoint)
    latest = read_latest(store)
    if latest is None:
        return {"error": f"no commit under {uri}"}
    counters = read_trainer_state(store, latest)["goodput"]
    keys = dict((*TRAINER_TIME, DEGRADED))  # the trainer's counter → its status.trainerTime field
    intervals = [(wall_s, "Running", {v: float(counters.get(k, 0.0)) for k, v in keys.items()})]
    held = ledger(intervals, GROUPS)
    return {"trainer_time": counters, "productive_s": held.productive_s, "degraded_s": held.degraded_s,
            "goodput": held.goodput, "cost": priced(intervals, GROUPS, *price)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--interval", type=int, default=500, help="checkpoint.intervalSteps")
    ap.add_argument("--kill-every", type=int, default=200, help="kill a group every N steps the job reports")
    ap.add_argument("--cold", action="store_true",
                    help="restart a killed group cold (a fresh torchrun that imports everything) instead of "
                         "releasing a standby that imported ahead")
    ap.add_argument("--heartbeat-ms", type=int, default=1000,
                    help="the lighthouse's heartbeat timeout (kiln run's: 1000; the operator's Deployment: 2000)")
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint (AWS_* keys from the environment)")
    ap.add_argument("--out", default="runs/bench/ft_groups.json")
    add_price_args(ap)
    args = ap.parse_args(argv)
    from tests.bench.bench_checkpoint import _server

    endpoint, creds, s3 = _server(args)
    os.environ.update(creds)  # the groups' environment (tests.support.runs.env) is this one's
    prefix = f"s3://kiln/bench-ft-groups-{uuid.uuid4().hex[:8]}"
    logs = Path(args.out).with_suffix(".logs")
    load = [os.getloadavg()]
    servers, jobs = [], []
    try:
        servers += [lighthouse_server(heartbeat_timeout_ms=args.heartbeat_ms) for _ in range(2)]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            for name, server, kill_every in (("reference", servers[0], 0), ("faulty", servers[1], args.kill_every)):
                run_spec = spec(tmp / f"{name}.yaml", args.steps, args.interval, f"{prefix}/{name}/", endpoint)
                logs.mkdir(parents=True, exist_ok=True)
                jobs.append(Job(name, tmp, run_spec, server.address(), logs, args.steps, kill_every,
                                warm=not args.cold))
            t0, next_load = time.monotonic(), 60.0
            while any(j.running() for j in jobs):
                time.sleep(POLL_S)
                now = time.monotonic() - t0
                if now > SAFETY_TIMEOUT_S * 3:
                    raise TimeoutError(f"no end after {SAFETY_TIMEOUT_S * 3} s")
                if now > next_load:
                    load.append(os.getloadavg())
                    next_load += 60.0
                for j in jobs:
                    j.poll(now)
            for j in jobs:
                j.poll(time.monotonic() - t0)
        ref = jobs[0].summary(None)
        faulty = jobs[1].summary(ref["gaps"])
        for name, part in (("reference", ref), ("faulty", faulty)):
            part["kiln_ledger"] = kiln_ledger(f"{prefix}/{name}/", endpoint, part["wall_s"],
                                              (args.price_per_gpu_hour, args.currency))
    finally:
        for gate in logs.glob("gate-*"):  # the standbys' FIFOs (tests.distributed.ft_helpers.Group)
            gate.unlink()
        for j in jobs:
            j.stop()
        for server in servers:
            server.shutdown()
        if s3 is not None:
            s3.stop()
    kills = faulty.get("kills", [])
    report = {
        "benchmark": "ft_groups", "groups": GROUPS, "steps": args.steps, "checkpoint_interval_steps": args.interval,
        "kill_every": args.kill_every, "heartbeat_timeout_ms": args.heartbeat_ms,
        "restart": "cold" if args.cold else "standby", "store": "s3", "load_avg_1m": [round(x[0], 2) for x in load],
        "reference": ref, "faulty": faulty,
        "kills": len(kills), "healed_from_peer": sum(k.get("restore") == "peer" for k in kills),
        "kill_every_s": faulty["wall_s"] / (len(kills) + 1),
        "max_gap_s": faulty["gaps"].get("max"), "reference_max_gap_s": ref["gaps"].get("max"),
        "goodput": faulty.get("goodput"), "goodput_p99": faulty.get("goodput_p99"),
        "kiln_goodput": faulty["kiln_ledger"].get("goodput"),
        "reference_kiln_goodput": ref["kiln_ledger"].get("goodput"),
        "degraded_s": faulty["degraded_s"], "kiln_degraded_s": faulty["kiln_ledger"].get("degraded_s"),
        "cost_per_fault": (per_fault(faulty["kiln_ledger"]["cost"], ref["kiln_ledger"]["cost"], len(kills),
                                     args.price_per_gpu_hour, args.currency)
                           if "cost" in faulty["kiln_ledger"] and "cost" in ref["kiln_ledger"] else None),
        "guard": faulty["guard"], "reference_guard": ref["guard"],
        "heal_s": _quantiles([k["heal_s"] for k in kills if k.get("heal_s") is not None]),
        "heal_gap_s": _quantiles([k["heal_gap_s"] for k in kills if k.get("heal_gap_s") is not None]),
        "kill_gap_s": _quantiles([k["kill_gap_s"] for k in kills if k.get("kill_gap_s") is not None]),
        "back_s": _quantiles([k["back_s"] for k in kills if k.get("back_s") is not None]),
        "breakdown_p50_s": {key: _quantiles([k[key] for k in kills if k.get(key) is not None]).get("p50")
                            for key in ("survivor_quorum_after_kill_s", "survivor_quorum_at_heal_s", "join_quorum_s",
                                        "heal_load_s", "first_step_s", "warm_up_s")},
        "reference_quorum_s": _quantiles([q for (_, st), q in jobs[0].quorum_s.items() if q is not None and st > 1]),
        "sample_share": (faulty["final_tokens_seen"] / ref["final_tokens_seen"]
                         if faulty["final_tokens_seen"] and ref["final_tokens_seen"] else None),
        "val_loss_diff": (faulty["final_val_loss"] - ref["final_val_loss"]
                          if None not in (faulty["final_val_loss"], ref["final_val_loss"]) else None),
        "groups_agree": len(faulty["final_weights_digests"]) == 1,
        "both_finished": ref["final_step"] == faulty["final_step"] == args.steps,
    }
    write_report(report, args.out, summary={k: v for k, v in report.items() if k not in ("reference", "faulty")})
    return report


if __name__ == "__main__":
    main()
