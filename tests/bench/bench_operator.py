"""Operator throughput on the rig: 200 TrainingSpecs created at once → time until each PyTorchJob exists.

Measured in the same run, as the reference: 200 PyTorchJobs created directly by a client (what the
apiserver + watch path alone costs). Reported: per-object latency p50/p99 for both, their ratio, the
time until the last job exists, and the operator's peak RSS (VmHWM) against its idle RSS.

Then, separately (so the counting does not slow the timed pass), a second operator talks to the apiserver
through a counting proxy while `--count-calls` TrainingSpecs are created at once: every request it makes
(kopf's and kiln's) until the runs settle, per TrainingSpec and by verb and resource.

    python -m tests.bench.bench_operator [--count 200] [--count-calls 20] [--out runs/bench/operator.json]

The runs are created suspended, so no pod or GPU is involved: this measures the operator.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from kubernetes import client, config as kconfig, watch

from kiln.api.load import dump_for_apply, parse
from kiln.control.kube import Kube, api_client
from kiln.control.plan import plan
from kiln.control.status import job_condition
from tests.bench.report import write_report
from tests.distributed.ranks import wait_until


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


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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

    def wait(self, names: list[str], alive=None) -> None:
        wait_until(f"{len(names)} PyTorchJobs", lambda: all(n in self.seen for n in names), alive=alive,
                   context=lambda: f"missing, e.g. {[n for n in names if n not in self.seen][:3]}")

    def stop(self) -> None:
        self._stop.set()


_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "authorization"}


class CountingProxy:
    """A plain-HTTP reverse proxy to the apiserver that records every request made through it.

    The operator under count talks to http://127.0.0.1:<port> without credentials; the proxy forwards with
    the credentials of `kubeconfig` (the rig's admin certificate). Watches are streamed through, counted apart.
    """

    def __init__(self, kubeconfig: Path):
        cfg = client.Configuration()
        kconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        self.upstream = cfg.host
        self.ssl = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        self.ssl.load_cert_chain(cfg.cert_file, cfg.key_file)
        self.calls: list[tuple[float, str, str]] = []  # (monotonic time, method, path), watches excluded
        self.watches: list[str] = []  # the paths of the watch requests
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        wait_until("the counting proxy", self._ready.is_set)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(self._start())
        self._ready.set()
        loop.run_forever()

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ssl, limit=0),
                                             auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("true", "1"):
            self.watches.append(request.path)
        else:
            self.calls.append((time.monotonic(), request.method, request.path))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                        data=body or None, timeout=aiohttp.ClientTimeout(total=None)) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await resp.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionError):  # the operator stopped mid-watch
                pass
            return resp

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for this proxy (no credentials: the proxy adds them)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}]}))
        return path


def call_kind(method: str, path: str) -> str:
    """'PATCH pytorchjobs', 'GET trainingspecs/status', ... from a request path."""
    parts = [p for p in path.split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]  # drop api/v1 or apis/<group>/<version>
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    resource = parts[0] if parts else "discovery"
    sub = f"/{parts[2]}" if len(parts) > 2 else ""
    verb = {"GET": "get" if len(parts) > 1 else "list"}.get(method, method.lower())
    return f"{verb} {resource}{sub}"


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


def specs(namespace: str, count: int) -> list[dict]:
    bodies = []
    for i in range(count):
        doc = parse(spec(f"run-{i}"))
        doc.metadata.namespace = namespace
        bodies.append(dump_for_apply(doc))
    return bodies


def create_specs(kube: Kube, namespace: str, bodies: list[dict]) -> dict[str, float]:
    return create_all(bodies, lambda b: kube.custom.create_namespaced_custom_object(
        "kiln.dev", "v1alpha1", namespace, "trainingspecs", b))


def unsettled(kube: Kube, namespace: str, names: list[str]) -> list[str]:
    """The runs whose status does not show their PyTorchJob's final state yet: a suspended run is settled once
    the training-operator has marked its job Suspended and the operator has derived the run's status from that
    (the run's Suspended condition carries the job's message; kiln.control.status.derive)."""
    jobs = {j["metadata"]["name"]: j for j in kube.custom.list_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs")["items"]}
    runs = {r["metadata"]["name"]: r for r in kube.custom.list_namespaced_custom_object(
        "kiln.dev", "v1alpha1", namespace, "trainingspecs")["items"]}

    def condition(obj: dict | None, ctype: str) -> dict:
        return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})

    def settled(name: str) -> bool:
        job, run = jobs.get(name), runs.get(name)
        if job_condition(job) != "Suspended":
            return False
        shown = condition(run, "Suspended")
        return shown.get("status") == "True" and shown.get("message") == (condition(job, "Suspended").get("message")
                                                                          or "phase Suspended")
    return [n for n in names if not settled(n)]


def count_calls(rig, kube: Kube, namespace: str, count: int, log: Path) -> dict:
    """Every request an operator makes for `count` new TrainingSpecs, until the runs settle.

    The window opens when the specs are created (the operator's watches being open) and closes when every
    run's status shows its PyTorchJob's final state (`unsettled`): it holds each run's reconcile and the status
    refreshes its PyTorchJob's events trigger — what a burst costs per run. Not a fixed time, which a slow
    machine overruns (cutting the count short) and a fast one pads. A window longer than the runs' periodic
    tick (kiln.control.handlers.TICK_S after a run is first seen) also holds their first ticks:
    `window_s` says how long it was.
    """
    from kiln.control.handlers import TICK_S
    from tests.integration.test_operator_lifecycle import Operator

    proxy = CountingProxy(rig.kubeconfig)
    op = Operator(proxy.kubeconfig(log.with_suffix(".kubeconfig")), namespace, log)
    op.start()  # returns once /healthz answers
    alive = lambda: op.proc.poll() is None  # noqa: E731
    try:
        # ready = watching both kinds: a spec created before its watch opens reaches the operator by a list
        wait_until("the operator's watches on trainingspecs and pytorchjobs", alive=alive, cond=lambda: all(
            any(p.endswith("/" + kind) for p in proxy.watches) for kind in ("trainingspecs", "pytorchjobs")))
        watcher = JobWatcher(kube, namespace)
        t0 = time.monotonic()
        created = create_specs(kube, namespace, specs(namespace, count))
        watcher.wait(list(created), alive=alive)
        jobs_at = max(watcher.seen.values())
        watcher.stop()
        left = list(created)

        def all_settled() -> bool:
            left[:] = unsettled(kube, namespace, left)
            return not left
        wait_until("every run's status showing its job Suspended", all_settled, alive=alive,
                   context=lambda: f"unsettled, e.g. {left[:3]}")
        t1 = time.monotonic()
        window = [c for c in proxy.calls if t0 <= c[0] <= t1]
    finally:
        op.stop()
    until_jobs = [c for c in window if c[0] <= jobs_at]
    kinds = Counter(call_kind(m, path) for _, m, path in window)
    return {"specs": count, "per_spec": len(window) / count, "per_spec_until_all_jobs_exist": len(until_jobs) / count,
            "by_kind_per_spec": {k: round(v / count, 2) for k, v in kinds.most_common()},
            "window_s": t1 - t0, "window_past_first_tick": t1 - t0 > TICK_S}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--count-calls", type=int, default=20, help="TrainingSpecs for the API-call count (0: skip)")
    parser.add_argument("--out", default="runs/bench/operator.json")
    args = parser.parse_args(argv)

    from tests.integration.test_operator_lifecycle import Operator
    from tests.integration.test_operator_api import install_crd
    from tests.rig import cluster

    rig, started = cluster.up(lease_pid=os.getpid())
    namespaces = [f"bench-{kind}-{uuid.uuid4().hex[:5]}" for kind in ("ref", "kiln", "calls")]
    ns_ref, ns_kiln, ns_calls = namespaces
    op = None
    calls = None
    try:
        install_crd(rig)
        for ns in namespaces:
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
        watcher.wait(list(created))
        ref_total = max(watcher.seen.values()) - t0
        ref = latencies(created, watcher.seen, {n: n for n in created})
        watcher.stop()

        # kiln: TrainingSpecs → operator → PyTorchJobs.
        log = Path(args.out).with_suffix(".operator.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        op = Operator(rig.kubeconfig, ns_kiln, log)
        op.start()  # returns once /healthz answers
        alive = lambda: op.proc.poll() is None  # noqa: E731
        watcher = JobWatcher(kube, ns_kiln)
        # ready = its first reconcile done (watches open, handlers imported): one run's PyTorchJob exists
        warm = specs(ns_kiln, 1)[0]
        warm["metadata"]["name"] = "warm-up"
        create_specs(kube, ns_kiln, [warm])
        watcher.wait(["warm-up"], alive=alive)
        idle_rss = rss_kib(op.proc.pid, "VmRSS")
        cpu0 = cpu_s(op.proc.pid)
        bodies = specs(ns_kiln, args.count)
        t0 = time.monotonic()
        created = create_specs(kube, ns_kiln, bodies)
        watcher.wait(list(created), alive=alive)
        kiln_total = max(watcher.seen.values()) - t0
        lat = latencies(created, watcher.seen, {n: n for n in created})
        peak_rss = rss_kib(op.proc.pid, "VmHWM")
        op_cpu = cpu_s(op.proc.pid) - cpu0
        watcher.stop()
        op.stop()
        op = None

        if args.count_calls:
            calls = count_calls(rig, kube, ns_calls, args.count_calls, log.with_suffix(".calls.log"))
    finally:
        if op:
            op.stop()
        for ns in namespaces:
            rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.release(os.getpid(), stop_if_unused=started)

    result = {
        "count": args.count,
        "kiln": {"p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "mean_s": statistics.mean(lat),
                 "all_jobs_exist_after_s": kiln_total, "runs_per_s": args.count / kiln_total,
                 # the operator's own CPU until the last job existed, per run: less sensitive than the times
                 # to whatever else shares the machine
                 "operator_cpu_ms_per_run": 1000 * op_cpu / args.count},
        "reference_direct_create": {"p50_s": percentile(ref, 0.5), "p99_s": percentile(ref, 0.99),
                                    "all_jobs_exist_after_s": ref_total},
        "ratio_p50": percentile(lat, 0.5) / percentile(ref, 0.5),
        "ratio_p99": percentile(lat, 0.99) / percentile(ref, 0.99),
        "ratio_all_jobs_exist": kiln_total / ref_total,
        "operator_rss_mib": {"idle": idle_rss / 1024, "peak": peak_rss / 1024,
                             "peak_over_idle": peak_rss / max(idle_rss, 1)},
        "api_calls": calls,
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
