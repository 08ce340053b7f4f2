"""Fault-injection benchmark in replica-group mode (elastic.faultTolerance replicaGroups, torchft).

A torchft lighthouse and 2 replica groups, each `kiln train` under its own torchrun (1 gloo worker, the
micro Llama, a commit every --interval steps by the replica-rank-0 group). Every --kill-every steps the job
reports, the watcher SIGKILLs one whole group (groups in turn: group 0 is the checkpoint writer at first)
and starts it again at once, as Kubernetes restarts a lost pod: a fresh torchrun that imports, builds the
model and heals from the live peer. The next kill waits until the previous group is back. The kills follow
the run's reported steps, not a clock. Measured against a fault-free run in the same invocation:
  max_gap_s        the longest time between two consecutive steps of the job (the highest step any live
                   group reported), fault-free and faulty
  goodput          fault-free wall time / faulty wall time for the same steps
  sample_share     samples trained / (steps × globalBatchSize): a step with one group live averages half the
                   batch (the data cursor moves by what was read)
  val_loss_diff    faulty − fault-free held-out loss at the end
Each kill's step, group, time until the group's first step again (`back_s`) and steps the survivor took
alone are in faulty.kills.

    python -m tests.bench.bench_ft_groups [--steps 2400] [--kill-every 500] [--out runs/bench/ft_groups.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.bench.report import write_report
from tests.distributed.ft_helpers import Group, lighthouse_server
from tests.distributed.ranks import POLL_S, SAFETY_TIMEOUT_S
from tests.distributed.trainer_helpers import write_spec

GROUPS = 2


def spec(path: Path, steps: int, interval: int, ckpt: Path) -> Path:
    return write_spec(path, training={"steps": steps, "seed": 1, "logEvery": 1},
                      checkpoint={"uri": f"file://{ckpt}", "intervalSteps": interval, "keep": 2},
                      resources={"processesPerNode": GROUPS},
                      elastic={"faultTolerance": {"mode": "replicaGroups", "groups": GROUPS}})


class _Tail:
    """New complete lines of a group's metrics.jsonl."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, ""

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
        return [json.loads(line) for line in lines if line.strip()]


def run(tmp: Path, name: str, lighthouse: str, steps: int, interval: int, kill_every: int, logs: Path) -> dict:
    run_spec = spec(tmp / f"{name}.yaml", steps, interval, tmp / name / "ckpt")
    logs.mkdir(parents=True, exist_ok=True)

    def start(index: int, n: int) -> tuple[Group, _Tail]:
        out = tmp / name / f"g{index}-{n}"
        return Group(index, run_spec, out, lighthouse, logs, f"{name}-g{index}-{n}", gated=False), \
            _Tail(out / "metrics.jsonl")

    live = {i: start(i, 0) for i in range(GROUPS)}
    everyone = [g for g, _ in live.values()]
    t0 = time.monotonic()
    first_seen: dict[int, float] = {}
    last: dict[int, dict] = {}
    kills: list[dict] = []
    pending: dict | None = None
    next_kill, victim = kill_every, 0
    try:
        while any(g.alive() for g in everyone):
            if time.monotonic() - t0 > SAFETY_TIMEOUT_S * 3:
                raise TimeoutError(f"{name}: no end after {SAFETY_TIMEOUT_S * 3} s")
            time.sleep(POLL_S)
            now = time.monotonic() - t0
            for index, (group, tail) in live.items():
                for r in tail.new():
                    first_seen.setdefault(r["step"], now)
                    last[index] = r
                    if pending is not None and index == pending["group"] and "back_at_step" not in pending:
                        pending.update(back_at_step=r["step"], back_s=now - pending["at_s"], restore=r["ft_restore"])
            job_step = max(first_seen, default=0)
            if pending is not None and "back_at_step" in pending:
                alone = [s for s in first_seen if pending["at_step"] < s < pending["back_at_step"]]
                pending["steps_alone"] = len(alone)
                pending = None
            if kill_every and pending is None and job_step >= next_kill and next_kill < steps - kill_every // 2:
                group, _ = live[victim]
                if group.alive():
                    group.kill()
                    pending = {"group": victim, "at_step": job_step, "at_s": now}
                    kills.append(pending)
                    live[victim] = start(victim, len(kills))
                    everyone.append(live[victim][0])
                    victim = (victim + 1) % GROUPS
                next_kill += kill_every
        end = time.monotonic() - t0
        rcs = [g.proc.returncode for g in everyone]
    finally:
        for g in everyone:
            g.stop()
    seen = [first_seen[s] for s in sorted(first_seen)]
    gaps = sorted(b - a for a, b in zip(seen, seen[1:]))
    finals = [r for r in last.values() if r["step"] == steps]
    return {
        "rcs_survivors_and_restarts": rcs,
        "wall_s": seen[-1] if seen else None,
        "exit_s": end,
        "steps_seen": len(seen),
        "final_step": max(first_seen, default=0),
        "max_gap_s": gaps[-1] if gaps else None,
        "p50_gap_s": gaps[len(gaps) // 2] if gaps else None,
        "p99_gap_s": gaps[int(len(gaps) * 0.99)] if gaps else None,
        "kills": kills,
        "final_val_loss": finals[0].get("val_loss") if finals else None,
        "final_weights_digests": sorted({r.get("ft_weights_digest") for r in finals}),
        "final_tokens_seen": finals[0]["tokens_seen"] if finals else None,
        "redone_steps": sum(r.get("ft_redone_steps", 0) for r in last.values()),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--interval", type=int, default=100, help="checkpoint.intervalSteps")
    ap.add_argument("--kill-every", type=int, default=500, help="kill a group when the job reports step N, 2N, ...")
    ap.add_argument("--out", default="runs/bench/ft_groups.json")
    args = ap.parse_args(argv)
    logs = Path(args.out).with_suffix("")
    server = lighthouse_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            ref = run(tmp, "reference", server.address(), args.steps, args.interval, 0, Path(f"{logs}.logs"))
            faulty = run(tmp, "faulty", server.address(), args.steps, args.interval, args.kill_every,
                         Path(f"{logs}.logs"))
    finally:
        server.shutdown()
    seq, batch = 32, 4  # the micro model's seqLen, training.globalBatchSize (tests.distributed.trainer_helpers)
    report = {
        "benchmark": "ft_groups", "groups": GROUPS, "steps": args.steps, "checkpoint_interval_steps": args.interval,
        "kill_every": args.kill_every, "reference": ref, "faulty": faulty,
        "kills": len(faulty["kills"]),
        "healed_from_peer": sum(k.get("restore") == "peer" for k in faulty["kills"]),
        "max_gap_s": faulty["max_gap_s"], "reference_max_gap_s": ref["max_gap_s"],
        "goodput": ref["wall_s"] / faulty["wall_s"] if ref["wall_s"] and faulty["wall_s"] else None,
        "sample_share": (faulty["final_tokens_seen"] / (args.steps * batch * seq)
                         if faulty["final_tokens_seen"] else None),
        "val_loss_diff": (faulty["final_val_loss"] - ref["final_val_loss"]
                          if None not in (faulty["final_val_loss"], ref["final_val_loss"]) else None),
        "groups_agree": len(faulty["final_weights_digests"]) == 1,
        "both_finished": ref["final_step"] == faulty["final_step"] == args.steps,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
