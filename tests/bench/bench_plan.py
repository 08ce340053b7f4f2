"""What one TrainingSpec with many replica groups costs the operator: plan() at the API's cap of groups.

Every resync renders a run's objects again, so plan()'s CPU time per spec is paid by every tenant on each pass.
For groups = 512, 1024, 2048 and 4096 (the cap, kiln.api.spec.MAX_REPLICA_GROUPS): CPU seconds of plan()
(the fastest of --repeat), the objects and their JSON bytes, and the CPU per PyTorchJob against the reference
measured in the same run: the CPU per PyTorchJob of a run without groups (one job; the mean of --ref-runs).
Linear in groups means the per-job ratio stays flat as groups grow. Then, in a pass of its own (tracing slows
it), the peak of Python allocations of one plan() at the cap.

    python -m tests.bench.bench_plan [--out runs/bench/plan.json] [--repeat 3] [--ref-runs 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import tracemalloc

from kiln.api.load import parse
from kiln.api.spec import MAX_REPLICA_GROUPS
from kiln.control.plan import plan
from tests.bench.report import write_report

SIZES = (512, 1024, 2048, MAX_REPLICA_GROUPS)


def spec(groups: int) -> dict:
    """`groups` replica groups of one 8-GPU node each (the most jobs a spec can ask for at the cap)."""
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
            "metadata": {"name": "wide", "namespace": "bench", "uid": "0000"},
            "spec": {"model": {"preset": "tiny"}, "training": {"steps": 10, "globalBatchSize": 8 * groups},
                     "resources": {"nodes": groups, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}}}
    if groups > 1:
        body["spec"]["elastic"] = {"faultTolerance": {"mode": "replicaGroups", "groups": groups}}
    return body


def cpu_seconds(doc, repeat: int) -> tuple[float, list[dict]]:
    best, objects = float("inf"), []
    for _ in range(repeat):
        start = time.process_time()
        objects = plan(doc).objects
        best = min(best, time.process_time() - start)
    return best, objects


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench/plan.json")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ref-runs", type=int, default=64)
    args = parser.parse_args(argv)

    load = {"start": os.getloadavg()[0]}
    one = parse(spec(1))
    plan(one)  # imports and first-use caches out of the timing
    start = time.process_time()
    for _ in range(args.ref_runs):
        plan(one)
    ref_per_job = (time.process_time() - start) / args.ref_runs

    sizes = []
    for groups in SIZES:
        seconds, objects = cpu_seconds(parse(spec(groups)), args.repeat)
        jobs = sum(o["kind"] == "PyTorchJob" for o in objects)
        assert jobs == groups, (jobs, groups)
        sizes.append({"groups": groups, "cpu_s": round(seconds, 4), "objects": len(objects),
                      "json_bytes": len(json.dumps(objects)), "cpu_per_job_ms": round(1000 * seconds / jobs, 4),
                      "per_job_vs_reference": round(seconds / jobs / ref_per_job, 3)})
        print(json.dumps(sizes[-1]), flush=True)

    doc = parse(spec(MAX_REPLICA_GROUPS))
    tracemalloc.start()
    objects = plan(doc).objects
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del objects
    load["end"] = os.getloadavg()[0]

    first, last = sizes[0], sizes[-1]
    result = {
        "benchmark": "plan", "commit": commit(), "host": platform.node(), "cpus": os.cpu_count(),
        "load_average_1m": load, "repeat": args.repeat,
        "reference": {"what": "plan() of a run without replica groups (1 PyTorchJob), mean of ref_runs",
                      "ref_runs": args.ref_runs, "cpu_per_job_ms": round(1000 * ref_per_job, 4)},
        "sizes": sizes,
        # linear: x (last/first groups) more groups cost about x more CPU; quadratic would be x²
        "growth": {"groups_ratio": last["groups"] / first["groups"], "cpu_ratio": round(last["cpu_s"] / first["cpu_s"], 2)},
        "peak_traced_mib_at_cap": round(peak / 2**20, 1),
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
