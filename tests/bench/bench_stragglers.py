"""Straggler-watch overhead: what kiln.trainer.observe.stragglers adds to a training step, against the step.

Two gloo ranks on this machine take the same small data-parallel MLP steps (forward, backward, a gradient
all-reduce, Adam), in alternating blocks with and without a `StragglerWatch` (everySteps 10, as the default):
the A/B difference of the median step times, and the watch's own cost measured directly (its per-step clock
reads, and its report, one all-gather of 2 floats per rank, every 10 steps) against the reference step measured
in the same run. The reference step is small (milliseconds): a real step is longer, so its overhead is smaller.

    python -m tests.bench.bench_stragglers [--blocks 10] [--block-steps 30] [--out runs/bench/stragglers.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.bench.report import write_report
from tests.support.ranks import run_ranks

EVERY = 10


def _worker(rank: int, world: int, blocks: int, block_steps: int) -> dict:
    from kiln.trainer.observe.stragglers import StragglerWatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {"plain": [], "watched": []}
    for block in range(blocks):
        for mode in ("plain", "watched") if block % 2 == 0 else ("watched", "plain"):
            watch = StragglerWatch(every=EVERY, factor=1.5, window=3, node="bench", device=torch.device("cpu")) \
                if mode == "watched" else None
            for i in range(block_steps):
                t0 = time.perf_counter()
                if watch is not None:
                    watch.begin()
                step()
                if watch is not None:
                    watch.end(i, {})
                times[mode].append(time.perf_counter() - t0)
    # the watch's own cost, directly: a step's clock reads, and a report (its all-gather) every EVERY steps
    watch = StragglerWatch(every=1, factor=1.5, window=3, node="bench", device=torch.device("cpu"))
    watch.begin()
    watch.end(0, {})  # the first step is not counted
    reads, reports = [], []
    for i in range(200):
        t0 = time.perf_counter()
        watch.begin()
        t1 = time.perf_counter()
        watch.end(i, {})  # every=1: each end() reports
        reports.append(time.perf_counter() - t1)
        reads.append(t1 - t0)
    return {mode: statistics.median(v) for mode, v in times.items()} | {
        "begin_s": statistics.median(reads), "report_s": statistics.median(reports)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block-steps", type=int, default=30)
    ap.add_argument("--out", default="runs/bench/stragglers.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_worker, 2, Path(tmp), args.blocks, args.block_steps, start="spawn")
    r = ranks[0]
    direct = 2 * r["begin_s"] + r["report_s"] / EVERY  # begin's and end's clock reads, a report per EVERY steps
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "stragglers", "commit": commit, "world": 2, "every_steps": EVERY,
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count(),
        "reference": "the same MLP data-parallel step without the watch, same run (median, alternating blocks)",
        "step_s_plain": r["plain"], "step_s_watched": r["watched"],
        "ab_overhead_fraction": (r["watched"] - r["plain"]) / r["plain"],
        "clock_reads_s": r["begin_s"], "report_s": r["report_s"],
        "direct_overhead_s_per_step": direct, "direct_overhead_fraction": direct / r["plain"],
        "per_rank": ranks,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
