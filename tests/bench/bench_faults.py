"""Fault-injection benchmark: kill a training worker every few seconds during a CPU run under torchrun.

`kiln train` runs on 2 gloo processes under torchrun's elastic agent (--max-restarts), checkpointing every
few steps. A watcher SIGKILLs one worker process --kill-every seconds after training last (re)started
making progress; the agent restarts the
workers, which resume from the last commit. Reported, against a reference run without kills measured in
the same invocation:
  goodput           reference wall time / faulty wall time for the same steps (the share of the faulty run's
                    time that was useful training)
  kill_to_step_s    mean time from a kill to the next completed step (restart + restore + one step)
  steps_redone      steps trained twice (done after the last commit before a kill)

    python -m tests.bench.bench_faults [--steps 120] [--kill-every 30] [--out runs/bench/faults.json]
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


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _run(spec: Path, out: Path, kill_every: float | None, max_restarts: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "-m", "kiln.cli.main", "train", "--config", str(spec),
           "--output", str(out)]
    metrics = out / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kills, recoveries, appended = [], [], 0
    next_kill = t0 + kill_every if kill_every else None
    pending_kill: float | None = None
    seen = 0
    while proc.poll() is None:
        time.sleep(0.1)
        n = _lines(metrics)
        now = time.monotonic()
        if n > seen:  # a step completed (a resume first rewrites the file shorter, then appends)
            if pending_kill is not None:
                recoveries.append(now - pending_kill)
                pending_kill = None
                next_kill = now + kill_every  # the next kill comes kill_every after training is back
            appended += n - seen
        seen = n
        if next_kill is not None and now >= next_kill and pending_kill is None and seen > 0:
            workers = _children(proc.pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)  # one worker dies, as on a lost GPU
                kills.append(now - t0)
                pending_kill = now
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rc": proc.returncode, "wall_s": wall, "final_step": records[-1]["step"] if records else 0,
            "kills": len(kills), "kill_to_step_s": recoveries, "steps_logged": appended,
            "final_loss": records[-1]["loss"] if records else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.intervalSteps")
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds of training between kills")
    ap.add_argument("--out", default="runs/bench/faults.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = _spec(tmp / "spec.yaml", args.steps, args.interval)
        ref = _run(spec, tmp / "ref", None, 0)
        faulty = _run(spec, tmp / "faulty", args.kill_every, 100)
    rec = faulty["kill_to_step_s"]
    report = {
        "benchmark": "faults", "steps": args.steps, "checkpoint_interval_steps": args.interval,
        "kill_every_s": args.kill_every, "reference": ref, "faulty": faulty,
        "goodput": ref["wall_s"] / faulty["wall_s"],
        "mean_kill_to_step_s": sum(rec) / len(rec) if rec else None,
        "steps_redone": faulty["steps_logged"] - faulty["final_step"],
        "both_finished": ref["final_step"] == faulty["final_step"] == args.steps,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
