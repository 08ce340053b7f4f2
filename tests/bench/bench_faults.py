"""Fault-injection benchmark: kill a training worker every few seconds during a CPU run under torchrun.

`kiln train` runs on 2 gloo processes under torchrun's elastic agent (--max-restarts), checkpointing every
few steps. A watcher SIGKILLs one worker process --kill-every seconds after training last (re)started
making progress; the agent restarts the
workers, which resume from the last commit. Reported, against a reference run without kills measured in
the same invocation:
  goodput           reference wall time / faulty wall time for the same steps (the share of the faulty run's
                    time that was useful training)
  kill_to_step_s    mean and max time from a kill to the next completed step (restart + restore + one step)
  steps_redone      steps trained twice (done after the last commit before a kill)
  final_loss_diff   faulty - reference final loss (0: the resumes were exact)
Each kill's time, killed rank, restored step, recovery time and redone steps are in faulty.kills.

    python -m tests.bench.bench_faults [--steps 120] [--kill-every 30] [--out runs/bench/faults.json]
    python -m tests.bench.bench_faults --steps 700 --kill-every 90 --max-kills 5   # several kills, ~8 min run
torchrun's and the workers' output go next to the report (<out>.reference.log, <out>.faulty.log).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kiln.control.plan import TORCHRUN_ENV
from tests.bench.report import write_report

MODEL = {"preset": "tiny", "dim": 64, "layers": 2, "heads": 4, "kvHeads": 2, "seqLen": 32, "ffnDim": 128}


def _spec(path: Path, steps: int, interval: int) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "faults"},
        "spec": {"model": MODEL, "data": {"uri": "builtin:pydoc"},
                 "training": {"steps": steps, "globalBatchSize": 8, "microBatchSize": 2, "lr": 1e-3,
                              "precision": "fp32", "seed": 1, "logEvery": 1},
                 "parallelism": {"compile": False}, "resources": {"processesPerNode": 2},
                 "checkpoint": {"intervalSteps": interval, "keep": 2}}}))
    return path


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)


def _complete_lines(path: Path) -> list[str]:
    """The whole lines of metrics.jsonl; a read that races the writer drops the unfinished last line."""
    try:
        return path.read_text().split("\n")[:-1]
    except OSError:
        return []


def _run(spec: Path, out: Path, kill_every: float | None, max_restarts: int, log: Path, max_kills: int = 0,
         last_step: int = 0, torchrun_env: dict[str, str] = TORCHRUN_ENV, timeout_s: float | None = None) -> dict:
    """Run `kiln train` under torchrun; with kill_every, SIGKILL one worker (ranks in turn) each time training
    has made kill_every seconds of progress since it last came back.

    Progress after a kill is the first metrics line the *new* workers wrote: a resume rewrites metrics.jsonl
    (truncated to the restored commit, then appended), so a line count can drop and rise again mid-rewrite,
    and the killed generation's rank 0 may still log a step after the kill. Hence: the workers must all be
    new, and the line must differ from the file as it was at the kill (same position, other text, or past
    its end). Its position is the restored commit, so steps redone = last step before the kill - commit.
    After timeout_s (if given) torchrun and its workers are killed and rc is None: a hung restart.
    """
    # torchrun_env: what the operator sets in trainer pods (kiln.control.plan.TORCHRUN_ENV). torchrun shares
    # one TCPStore across restarts by default, and the workers' env:// rendezvous adds no per-attempt prefix:
    # a restarted generation can read the dead one's gloo addresses (connectFullMesh "Connection refused",
    # or a wait of up to the 30 min store timeout). Opting out gives every attempt a fresh store.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **torchrun_env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "-m", "kiln.cli.main", "train", "--config", str(spec),
           "--output", str(out)]
    metrics = out / "metrics.jsonl"
    t0 = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    log_file = log.open("w")  # torchrun's and the workers' output: why a generation failed, if one did
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[dict] = []
    next_kill = None  # kill_every after the first step: start-up is not training time
    pending: dict | None = None  # the kill not yet recovered from
    peak = 0  # the most steps the current generation had logged
    timed_out = False
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if timeout_s is not None and now - t0 > timeout_s:
                timed_out = True  # a hung restart: the finally below kills torchrun and its workers
                break
            if pending is None:
                peak = max(peak, len(_complete_lines(metrics)))
                if kill_every and next_kill is None and peak > 0:
                    next_kill = now + kill_every
                # no kill once the last step is logged: a restart then only finds the final commit, no step follows
                if next_kill is not None and now >= next_kill and not 0 < max_kills <= len(kills) \
                        and not 0 < last_step <= peak:
                    workers = _children(proc.pid)
                    if workers:
                        victim = workers[len(kills) % len(workers)]  # ranks in turn: rank 0 also commits and logs
                        rank = _rank_of(victim)
                        os.kill(victim, signal.SIGKILL)  # one worker dies, as on a lost GPU
                        pending = {"at_s": now - t0, "rank": rank, "old": set(workers),
                                   "lines": _complete_lines(metrics)}
                        kills.append(pending)
                continue
            workers = set(_children(proc.pid))
            lines = _complete_lines(metrics)
            if not workers or workers & pending["old"]:
                # the killed generation's rank 0 may still log a step in flight: that is old, not recovery
                pending["lines"], peak = lines, max(peak, len(lines))
                continue  # the agent has not restarted the workers yet
            first_new = next((i for i, line in enumerate(lines) if i >= len(pending["lines"]) or line != pending["lines"][i]),
                             None)
            if first_new is None:
                continue  # restoring, or in the middle of rewriting the file
            pending.update(kill_to_step_s=now - t0 - pending["at_s"], resumed_from_step=first_new,
                           steps_redone=peak - first_new)
            pending, peak = None, len(lines)
            next_kill = now + kill_every  # the next kill comes kill_every after training is back
    finally:
        if proc.poll() is None:  # timed out, interrupted, or the watcher failed: leave no training behind
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker generation (its own session)
            proc.wait()
    wall = time.monotonic() - t0
    log_file.close()
    records = [json.loads(line) for line in _complete_lines(metrics) if line.strip()]
    for k in kills:
        del k["old"], k["lines"]
    # torchrun's agent logs each failed worker group once: more failures than kills = failures of its own
    failures = log.read_text(errors="replace").count("failed (exitcode")
    return {"rc": None if timed_out else proc.returncode, "wall_s": wall, "final_step": records[-1]["step"] if records else 0,
            "kills": kills, "worker_group_failures": failures, "final_loss": records[-1]["loss"] if records else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.intervalSteps")
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds of training between kills")
    ap.add_argument("--max-kills", type=int, default=0, help="stop killing after this many (0: no limit)")
    ap.add_argument("--out", default="runs/bench/faults.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = _spec(tmp / "spec.yaml", args.steps, args.interval)
        logs = Path(args.out).with_suffix("")
        ref = _run(spec, tmp / "ref", None, 0, Path(f"{logs}.reference.log"))
        faulty = _run(spec, tmp / "faulty", args.kill_every, 100, Path(f"{logs}.faulty.log"), args.max_kills,
                      args.steps)
    rec = [k["kill_to_step_s"] for k in faulty["kills"] if "kill_to_step_s" in k]
    report = {
        "benchmark": "faults", "steps": args.steps, "checkpoint_interval_steps": args.interval,
        "kill_every_s": args.kill_every, "reference": ref, "faulty": faulty,
        "kills": len(faulty["kills"]),
        "recovered": len(rec),
        "goodput": ref["wall_s"] / faulty["wall_s"],
        "mean_kill_to_step_s": sum(rec) / len(rec) if rec else None,
        "max_kill_to_step_s": max(rec) if rec else None,
        "steps_redone": sum(k.get("steps_redone", 0) for k in faulty["kills"]),
        "final_loss_diff": (faulty["final_loss"] - ref["final_loss"]
                            if None not in (faulty["final_loss"], ref["final_loss"]) else None),
        "both_finished": ref["rc"] == faulty["rc"] == 0 and ref["final_step"] == faulty["final_step"] == args.steps,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
