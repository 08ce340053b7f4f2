"""Operator throughput on the rig: 200 TrainingSpecs created at once → time until each PyTorchJob exists.

Measured in the same run, as the reference: 200 PyTorchJobs created directly by a client (what the
apiserver + watch path alone costs). Reported: per-object latency p50/p99 for both, their ratio, the
time until the last job exists, and the operator's peak RSS (VmHWM) against its idle RSS.

    python -m tests.bench.bench_operator [--count 200] [--out runs/bench/operator.json]

The runs are created suspended, so no pod or GPU is involved: this measures the operator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import watch

from kiln.api.load import dump_for_apply, parse
from kiln.control.kube import Kube, api_client
from kiln.control.plan import plan
from tests.bench.report import write_report


def spec(name: str) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name},
            "spec": {"suspend": True, "model": {"preset": "tiny"}, "data": {"uri": "synthetic"},
                     "training": {"steps": 10, "globalBatchSize": 8},
                     "resources": {"nodes": 1, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"}}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class JobWatcher:
    """Records when each PyTorchJob of a namespace is first seen by a watch."""

    def __init__(self, kube: Kube, namespace: str):
        self.seen: dict[str, float] = {}
        self.kube, self.namespace = kube, namespace
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        w = watch.Watch()
        while not self._stop.is_set():
            for event in w.stream(self.kube.custom.list_namespaced_custom_object, "kubeflow.org", "v1",
                                  self.namespace, "pytorchjobs", timeout_seconds=5):
                name = event["object"]["metadata"]["name"]
                self.seen.setdefault(name, time.monotonic())
                if self._stop.is_set():
                    break

    def wait(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(n in self.seen for n in names):
            time.sleep(0.05)
        missing = [n for n in names if n not in self.seen]
        if missing:
            raise TimeoutError(f"{len(missing)} PyTorchJobs never appeared, e.g. {missing[:3]}")

    def stop(self) -> None:
        self._stop.set()


def create_all(bodies: list[dict], create) -> dict[str, float]:
    """Create every object from 16 threads at once; returns name → time the create returned."""
    created: dict[str, float] = {}

    def one(body):
        create(body)
        created[body["metadata"]["name"]] = time.monotonic()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, bodies))
    return created


def latencies(created: dict[str, float], seen: dict[str, float], names: dict[str, str]) -> list[float]:
    return [seen[names[n]] - created[n] for n in created]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--out", default="runs/bench/operator.json")
    args = parser.parse_args(argv)

    from tests.integration.test_operator_lifecycle import Operator
    from tests.integration.test_operator_api import install_crd
    from tests.rig import cluster

    rig, started = cluster.up(lease_pid=os.getpid())
    ns_ref, ns_kiln = f"bench-ref-{uuid.uuid4().hex[:5]}", f"bench-kiln-{uuid.uuid4().hex[:5]}"
    op = None
    try:
        install_crd(rig)
        for ns in (ns_ref, ns_kiln):
            rig.kubectl("create", "namespace", ns)
        kube = Kube(api_client(str(rig.kubeconfig)))

        # Reference: the same PyTorchJobs kiln would render, created directly.
        watcher = JobWatcher(kube, ns_ref)
        jobs = []
        for i in range(args.count):
            doc = parse(spec(f"run-{i}"))
            doc.metadata.namespace = ns_ref
            jobs.append(next(o for o in plan(doc).objects if o["kind"] == "PyTorchJob"))
        t0 = time.monotonic()
        created = create_all(jobs, lambda b: kube.custom.create_namespaced_custom_object(
            "kubeflow.org", "v1", ns_ref, "pytorchjobs", b))
        watcher.wait(list(created), timeout=300)
        ref_total = max(watcher.seen.values()) - t0
        ref = latencies(created, watcher.seen, {n: n for n in created})
        watcher.stop()

        # kiln: TrainingSpecs → operator → PyTorchJobs.
        log = Path(args.out).with_suffix(".operator.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        op = Operator(rig.kubeconfig, ns_kiln, log)
        op.start()
        time.sleep(2)
        idle_rss = rss_kib(op.proc.pid, "VmRSS")
        watcher = JobWatcher(kube, ns_kiln)
        bodies = []
        for i in range(args.count):
            doc = parse(spec(f"run-{i}"))
            doc.metadata.namespace = ns_kiln
            bodies.append(dump_for_apply(doc))
        t0 = time.monotonic()
        created = create_all(bodies, lambda b: kube.custom.create_namespaced_custom_object(
            "kiln.dev", "v1alpha1", ns_kiln, "trainingspecs", b))
        watcher.wait(list(created), timeout=600)
        kiln_total = max(watcher.seen.values()) - t0
        lat = latencies(created, watcher.seen, {n: n for n in created})
        peak_rss = rss_kib(op.proc.pid, "VmHWM")
        watcher.stop()
    finally:
        if op:
            op.stop()
        for ns in (ns_ref, ns_kiln):
            rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.release(os.getpid(), stop_if_unused=started)

    result = {
        "count": args.count,
        "kiln": {"p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "mean_s": statistics.mean(lat),
                 "all_jobs_exist_after_s": kiln_total},
        "reference_direct_create": {"p50_s": percentile(ref, 0.5), "p99_s": percentile(ref, 0.99),
                                    "all_jobs_exist_after_s": ref_total},
        "ratio_p50": percentile(lat, 0.5) / percentile(ref, 0.5),
        "ratio_p99": percentile(lat, 0.99) / percentile(ref, 0.99),
        "operator_rss_mib": {"idle": idle_rss / 1024, "peak": peak_rss / 1024,
                             "peak_over_idle": peak_rss / max(idle_rss, 1)},
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
