"""Fault-injection benchmark: kill a training worker every N reported steps during a CPU run under torchrun.

`kiln train` runs on 2 gloo processes under torchrun's elastic agent (--max-restarts), checkpointing every
few steps. A watcher SIGKILLs one worker process (ranks in turn) when the run reports step N, 2N, ...
(--kill-every N, below --steps, at most --max-kills); the agent restarts the workers, which resume from the
last commit. The kills follow the run's reported steps, not a clock, so a fast machine gets the same kills
as a slow one. Reported, against a reference run without kills measured in the same invocation:
  goodput           reference wall time / faulty wall time for the same steps (the share of the faulty run's
                    time that was useful training)
  kill_to_step_s    mean and max time from a kill to the next completed step (restart + restore + one step)
  steps_redone      steps trained twice (done after the last commit before a kill)
  final_loss_diff   faulty - reference final loss (0: the resumes were exact)
  cost              what the faults cost (tests/bench/fault_cost.py): each run's timeline through the operator's
                    goodput ledger and status.cost at 2 devices (ranks), GPU-hours by cause and their amount at
                    --price-per-gpu-hour, and per_fault: the faulty run's less the reference's, per kill
  restart_breakdown where kill → next step goes, from the trainer's own marks (`startup` in the first record
                    of each process): respawn (kill → the new process exists: torchrun sees the dead worker,
                    stops the others, starts a generation), imports (interpreter, torch, kiln), rendezvous
                    (init_process_group), model (build, parallelize, optimizer), restore (data, checkpoint
                    read and load, or a new run's initialisation), first_step (the first step, compile
                    included when on); mean and max over the kills, and the same phases of the reference
                    run's cold start (launch → first step) for scale, measured in the same invocation
Each kill's time, killed rank, restored step, recovery time, redone steps and breakdown are in faulty.kills.

    python -m tests.bench.bench_faults [--steps 400] [--kill-every 100] [--out runs/bench/faults.json]
    python -m tests.bench.bench_faults --steps 1600 --kill-every 300 --max-kills 5   # 5 kills
    python -m tests.bench.bench_faults --price-per-gpu-hour 2.5 --currency EUR      # the faults' cost at a price
    python -m tests.bench.bench_faults --steps 100 --kill-every 30 --rounds 2 \
        --variants "before=REV:cold,after=HEAD:warm"      # restart cost before/after, back to back
--variants runs each NAME=REV:ENTRY in turn (a reference and a faulty run each), with kiln as committed at REV
(git archive of operator/ on PYTHONPATH; "." the working tree) and ENTRY cold (`-m kiln.cli.main`) or warm
(`-m kiln.cli.warm`, what trainer pods run); each round swaps the order, and `compare` gives each variant's
phase means over the first's, round by round, with the load average before and after each variant.
torchrun's and the workers' output go next to the report (<out>.reference.log, <out>.faulty.log; with
--variants <out>.NAME-ROUND.reference.log, ...).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from tests.bench.fault_cost import add_price_args, per_fault, priced, timeline
from tests.bench.report import write_report
from tests.support.ranks import TORCHRUN_ENV, torchrun_train_with_kills
from tests.support.runs import write_spec


NPROC = 2  # workers (devices) of each run


def spec(path: Path, steps: int, interval: int) -> Path:
    """The micro Llama on 2 processes, a step logged each step, a commit every `interval` steps (keep 2)."""
    return write_spec(path, nproc=NPROC, training={"steps": steps, "globalBatchSize": 8, "microBatchSize": 2,
                                               "seed": 1, "logEvery": 1},
                      checkpoint={"intervalSteps": interval, "keep": 2})


PHASES = (("respawn", None, "process_start"), ("imports", "process_start", "imports_done"),
          ("rendezvous", "imports_done", "rendezvous_done"), ("model", "rendezvous_done", "model_built"),
          ("restore", "model_built", "restored"), ("first_step", "restored", "first_step_done"))


def breakdown(started_at: float, marks: dict | None) -> dict | None:
    """Seconds of each phase of a start, from `started_at` (the kill, or the launch) through the trainer's marks."""
    if not marks or marks.get("process_start") is None:
        return None
    out = {name: marks[end] - (started_at if begin is None else marks[begin]) for name, begin, end in PHASES}
    out["total"] = marks["first_step_done"] - started_at
    return out


def summarize(parts: list[dict]) -> dict | None:
    """Mean and max of each phase over several starts."""
    if not parts:
        return None
    return {name: {"mean": sum(p[name] for p in parts) / len(parts), "max": max(p[name] for p in parts)}
            for name in (*(n for n, _, _ in PHASES), "total")}


def kill_steps(steps: int, every: int, max_kills: int) -> list[int]:
    """every, 2*every, ... below the last step (a kill there would have no next step to time)."""
    at = list(range(every, steps, every))
    return at[:max_kills] if max_kills else at


ENTRIES = {"cold": "kiln.cli.main", "warm": "kiln.cli.warm"}  # what torchrun runs per rank (warm: forked)


def variants(text: str) -> list[tuple[str, str, str]]:
    """"before=REV:cold,after=HEAD:warm" -> [(name, rev, entry module)]; REV "" or "." is the working tree."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, rest = item.partition("=")
        rev, _, entry = rest.partition(":")
        if not name or entry not in ENTRIES:
            raise SystemExit(f"--variants: {item!r}: want NAME=REV:cold or NAME=REV:warm")
        out.append((name, rev if rev != "." else "", ENTRIES[entry]))
    return out


def source_tree(rev: str, into: Path) -> str:
    """kiln's package as committed at `rev` (git archive of operator/), for PYTHONPATH: the variants' code
    without the working tree's uncommitted edits; "" = the installed (working tree) package."""
    if not rev:
        return ""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "operator"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into / "operator")


def run_pair(run_spec: Path, tmp: Path, logs: Path, args, planned: list[int], *, pythonpath: str = "",
             entry: str = ENTRIES["cold"]) -> dict:
    """A reference run (no kills) and a faulty one (the planned kills) with one code version and entry."""
    env = {**TORCHRUN_ENV, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    ref = torchrun_train_with_kills(run_spec, tmp / "ref", log=Path(f"{logs}.reference.log"), nproc=NPROC,
                                    total_steps=args.steps, torchrun_env=env, entry=entry)
    faulty = torchrun_train_with_kills(run_spec, tmp / "faulty", log=Path(f"{logs}.faulty.log"), nproc=NPROC,
                                       kill_at_steps=planned, total_steps=args.steps, max_restarts=100,
                                       torchrun_env=env, entry=entry)
    price = (args.price_per_gpu_hour, args.currency)
    costs = {name: priced(timeline(run), NPROC, *price) for name, run in (("reference", ref), ("faulty", faulty))}
    rec = [k["kill_to_step_s"] for k in faulty["kills"] if "kill_to_step_s" in k]
    for k in faulty["kills"]:
        k["breakdown"] = breakdown(k["at_epoch"], k.get("startup"))
    restarts = [k["breakdown"] for k in faulty["kills"] if k["breakdown"]]
    cold, summary = breakdown(ref["t0_epoch"], ref.get("startup")), summarize(restarts)
    return {
        "reference": ref, "faulty": faulty,
        "kills": len(faulty["kills"]),
        "recovered": len(rec),
        "goodput": ref["wall_s"] / faulty["wall_s"],
        "mean_kill_to_step_s": sum(rec) / len(rec) if rec else None,
        "max_kill_to_step_s": max(rec) if rec else None,
        "steps_redone": sum(k.get("steps_redone", 0) for k in faulty["kills"]),
        "cost": {**costs, "per_fault": per_fault(costs["faulty"], costs["reference"], len(faulty["kills"]), *price)},
        "restart_breakdown": summary,
        "cold_start_breakdown": cold,
        # share of a restart's time that is each phase, and a restart against the cold start of the reference
        "restart_share": ({name: v["mean"] / summary["total"]["mean"] for name, v in summary.items()
                           if name != "total"} if summary else None),
        "restart_vs_cold_start": summary["total"]["mean"] / cold["total"] if summary and cold else None,
        "final_loss_diff": (faulty["final_loss"] - ref["final_loss"]
                            if None not in (faulty["final_loss"], ref["final_loss"]) else None),
        "both_finished": ref["rc"] == faulty["rc"] == 0 and ref["final_step"] == faulty["final_step"] == args.steps,
        "all_kills_done": len(faulty["kills"]) == len(planned) == len(rec),
    }


def compare(rounds: list[dict[str, dict]], base: str) -> dict:
    """Each variant against `base`, round by round (the variants of a round ran back to back, under about
    the same load): the ratio of the mean kill → next step and of each phase's mean, and their medians.
    `ratio_to_BASE` has one entry per round, None where either variant measured no restart; such rounds,
    and any whose base total is 0, are left out of the median and listed in `unmeasured_rounds`."""
    out = {}
    for name in rounds[0]:
        per_round = []
        for r in rounds:
            a, b = r[name]["restart_breakdown"], r[base]["restart_breakdown"]
            per_round.append({phase: a[phase]["mean"] / b[phase]["mean"] if b[phase]["mean"] > 0 else None
                              for phase in b} if a and b else None)
        totals = [p["total"] for p in per_round if p and p["total"] is not None]
        out[name] = {"ratio_to_" + base: per_round,
                     "median_total_ratio": statistics.median(totals) if totals else None,
                     "unmeasured_rounds": [i for i, p in enumerate(per_round) if not p or p["total"] is None]}
    return out


def load_average() -> list[float]:
    return list(os.getloadavg())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.intervalSteps")
    ap.add_argument("--kill-every", type=int, default=100, help="kill when the run reports step N, 2N, ...")
    ap.add_argument("--max-kills", type=int, default=0, help="stop killing after this many (0: no limit)")
    ap.add_argument("--variants", default="",
                    help="compare code versions and entries, e.g. 'before=REV:cold,after=HEAD:warm' (the first is "
                         "the base of the ratios); each round runs every variant back to back")
    ap.add_argument("--rounds", type=int, default=1, help="with --variants: how many alternating rounds")
    ap.add_argument("--out", default="runs/bench/faults.json")
    add_price_args(ap)
    args = ap.parse_args(argv)
    planned = kill_steps(args.steps, args.kill_every, args.max_kills)
    logs = Path(args.out).with_suffix("")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_spec = spec(tmp / "spec.yaml", args.steps, args.interval)
        if not args.variants:
            report = {"benchmark": "faults", "steps": args.steps, "checkpoint_interval_steps": args.interval,
                      "kill_at_steps": planned, "load_average_before": load_average(),
                      **run_pair(run_spec, tmp, logs, args, planned), "load_average_after": load_average()}
            write_report(report, args.out)
            return report
        chosen = variants(args.variants)
        trees = {name: source_tree(rev, tmp / "src" / name) for name, rev, _ in chosen}
        rounds = []
        for i in range(args.rounds):
            this = {}
            for name, rev, entry in (chosen if i % 2 == 0 else chosen[::-1]):  # alternate who goes first
                load = load_average()
                this[name] = {"rev": rev, "entry": entry, "load_average_before": load,
                              **run_pair(run_spec, tmp / f"{name}-{i}", Path(f"{logs}.{name}-{i}"), args, planned,
                                         pythonpath=trees[name], entry=entry),
                              "load_average_after": load_average()}
            rounds.append(this)
    base = chosen[0][0]
    report = {"benchmark": "faults", "steps": args.steps, "checkpoint_interval_steps": args.interval,
              "kill_at_steps": planned, "variants": [{"name": n, "rev": r, "entry": e} for n, r, e in chosen],
              "rounds": rounds, "compare": compare(rounds, base)}
    summary = {"compare": report["compare"],
               "rounds": [{name: {k: v[k] for k in ("rev", "entry", "load_average_before", "mean_kill_to_step_s",
                                                      "restart_breakdown", "cold_start_breakdown", "goodput", "cost",
                                                      "final_loss_diff", "both_finished", "all_kills_done")}
                           for name, v in r.items()} for r in rounds]}
    write_report(report, args.out, summary=summary)
    return report


if __name__ == "__main__":
    main()
