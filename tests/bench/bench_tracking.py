"""Tracking overhead: what `spec.tracking` (MLflow, a record every step) adds to a training step of the CPU preset
when the tracker answers every request 500 ms late.

The tracker is a real MLflow server (tests/mlflow_server.py) behind a proxy of this benchmark's own that holds
every request for `--delay` seconds before passing it on (tests/delay_proxy.py, its own process). The real
training loop (`kiln.trainer.loop.train`, the `tiny` preset, `logEvery: 1`) runs in alternating blocks with and
without `tracking.mlflow` pointed at the proxy, in this one process; a step's time is the wall time between
consecutive passes just after the optimizer step, so it holds everything the loop does per step, the tracker's
`offer` included. Reported: the A/B difference of the median (and of the fastest) step times, and the loop's
own tracking work measured directly (each `Tracking.offer` and `Tracking.commit` call, timed around kiln's own
code) against the untracked step of the same run; the sender thread's CPU time per record (what it could take
from the step through the interpreter lock); and what reached MLflow (steps logged, records dropped), read
back from the server itself.

    python -m tests.bench.bench_tracking [--pairs 3] [--steps 40] [--delay 0.5] [--out runs/bench/tracking.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.bench.report import write_report

WARMUP = 3  # unmeasured steps at the start of each block (allocator, first-step work)


def make_spec(steps: int, batch: int, tracker_uri: str | None, experiment: str):
    from kiln.api import TrainingSpec

    return TrainingSpec.model_validate({
        "metadata": {"name": "bench-tracking"},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"uri": "synthetic"},
            "training": {"steps": steps, "globalBatchSize": batch, "microBatchSize": batch, "lr": 1e-4,
                         "warmupSteps": 0, "schedule": "constant", "precision": "fp32", "logEvery": 1},
            "parallelism": {"compile": False},
            "checkpoint": {"intervalSteps": 10**9},
            **({"tracking": {"mlflow": {"uri": tracker_uri, "experiment": experiment}}} if tracker_uri else {}),
        },
    })


def timed_tracking_calls() -> dict[str, list[float]]:
    """Time every `Tracking.offer` / `Tracking.commit` call (the loop's whole share of tracking) from here on."""
    from kiln.trainer.observe import tracking

    spent: dict[str, list[float]] = {"offer": [], "commit": []}
    for name in spent:
        original = getattr(tracking.Tracking, name)

        def timed(self, *args, _original=original, _into=spent[name]):
            t0 = time.perf_counter()
            _original(self, *args)
            _into.append(time.perf_counter() - t0)

        setattr(tracking.Tracking, name, timed)
    return spent


def sender_cpu_per_record(uri: str, record: dict, spec, n: int) -> float:
    """CPU seconds the sender thread spends per record (its share of the interpreter, which a step could feel):
    n records through kiln's Tracking to `uri`, with the main thread idle meanwhile, so the process's CPU time is
    the sender's (the run's opening, its parameters, included: an upper bound)."""
    from kiln.trainer.observe.tracking import MlflowTracker, Tracking, flat_params

    params = flat_params(spec.spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    cpu0 = time.process_time()
    tracking = Tracking([MlflowTracker(uri, "sender-cpu", "sender-cpu")], params=params)
    for step in range(1, n + 1):
        tracking.offer({**record, "step": step})
    tracking.close(timeout=600)
    assert not tracking.errors and not tracking.dropped, (tracking.errors, tracking.dropped)
    return (time.process_time() - cpu0) / n


def run_block(spec, out: Path) -> tuple[list[float], float]:
    """(each measured step's wall time, seconds from the last step until train() returned)."""
    from kiln.trainer.loop import StepHooks, train

    stamps: list[float] = []
    hooks = StepHooks()
    hooks.after_update.append(lambda ctx: stamps.append(time.perf_counter()))
    train(spec, output_dir=out, hooks=hooks, checkpointing=False)
    ended = time.perf_counter()
    steps = [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]
    return steps, ended - stamps[-1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="blocks with and without tracking, alternating order")
    ap.add_argument("--steps", type=int, default=40, help="steps per block (the first few are not measured)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds the proxy holds each request")
    ap.add_argument("--sender-records", type=int, default=20, help="records for the sender's CPU time")
    ap.add_argument("--out", default="runs/bench/tracking.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_PORT", "29541")
    from mlflow.tracking import MlflowClient

    from tests import delay_proxy, mlflow_server

    spent = timed_tracking_calls()
    with tempfile.TemporaryDirectory() as tmp:
        server = mlflow_server.start(Path(tmp) / "mlflow")
        proxy = delay_proxy.start(server.uri, args.delay)
        try:
            t0 = time.perf_counter()
            mlflow_server.healthy(proxy.uri)
            latency = time.perf_counter() - t0  # one request through the proxy, as the tracker sees it
            steps: dict[str, list[float]] = {"untracked": [], "tracked": []}
            drain: list[float] = []
            blocks = []
            for pair in range(args.pairs):
                for mode in ("untracked", "tracked") if pair % 2 == 0 else ("tracked", "untracked"):
                    experiment = f"bench-{pair}"
                    spec = make_spec(args.steps, args.batch, proxy.uri if mode == "tracked" else None, experiment)
                    out = Path(tmp) / f"{mode}-{pair}"
                    block_steps, end_s = run_block(spec, out)
                    steps[mode] += block_steps
                    block = {"mode": mode, "median_step_s": statistics.median(block_steps)}
                    if mode == "tracked":
                        drain.append(end_s)
                        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                        client = MlflowClient(server.uri)  # the server itself, not through the proxy
                        [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
                        block |= {"steps_logged_to_mlflow": len(client.get_metric_history(run.info.run_id, "loss")),
                                  "records_dropped": max((r.get("tracking_dropped", 0) for r in records), default=0),
                                  "tracking_errors": sorted({r["tracking_error"] for r in records
                                                             if "tracking_error" in r}),
                                  "seconds_after_last_step_until_train_returned": end_s}
                    blocks.append(block)
            sender_cpu = sender_cpu_per_record(proxy.uri, records[-1], make_spec(args.steps, args.batch, proxy.uri, "cpu"),
                                               args.sender_records)
        finally:
            proxy.stop()
            server.stop()

    plain, tracked = statistics.median(steps["untracked"]), statistics.median(steps["tracked"])
    offer, commit = statistics.median(spent["offer"]), statistics.median(spent["commit"])
    direct = offer + commit  # the loop calls each once per step at logEvery 1
    result = {
        "bench": "tracking", "preset": "tiny", "batch": args.batch, "log_every": 1,
        "steps_per_block": args.steps, "measured_steps_per_block": args.steps - WARMUP - 1, "pairs": args.pairs,
        "tracker": "MLflow server (sqlite) behind a proxy holding each request",
        "proxy_delay_s": args.delay, "measured_request_latency_s": latency,
        "reference": "the same run without spec.tracking, alternating blocks in the same process",
        "step_s_untracked": plain, "step_s_tracked": tracked,
        "fastest_step_s_untracked": min(steps["untracked"]), "fastest_step_s_tracked": min(steps["tracked"]),
        "ab_overhead_fraction": (tracked - plain) / plain,
        "ab_overhead_fraction_fastest": (min(steps["tracked"]) - min(steps["untracked"])) / min(steps["untracked"]),
        "offer_s_median": offer, "offer_s_max": max(spent["offer"]), "commit_s_median": commit,
        "direct_overhead_s_per_step": direct, "direct_overhead_fraction": direct / plain,
        "sender_cpu_s_per_record": sender_cpu, "sender_cpu_fraction_of_step": sender_cpu / plain,
        "blocks": blocks,
        "note": "train() returns after the run's end has sent what was queued (at most 30 s): that wait is after "
                "the last step, not in any step",
    }
    write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
