"""Operator throughput and the cost of its periodic tick, on the rig.

Burst: 200 TrainingSpecs created at once → time until each PyTorchJob exists. Measured in the same run, as the
reference: a client creating, per run, the same objects the operator writes for it (ServiceAccount, Role,
RoleBinding, NetworkPolicy, ConfigMap, PyTorchJob), 16 runs at a time as the TrainingSpecs are, once before and
once after kiln's burst (kiln is compared with their mean: the shared machine's load moves). Reported: per-run
latency (from the first request for the run to its PyTorchJob seen by a watch) p50/p99 for both, their ratio, the
time until the last job exists, and the operator's peak RSS (VmHWM) against its idle RSS.

Then, separately (so the counting does not slow the timed pass), a second operator talks to the apiserver
through a counting proxy while `--count-calls` TrainingSpecs are created at once: every request it makes
(kopf's and kiln's) until the runs settle, per TrainingSpec and by verb and resource.

Scale (`--scale-runs N --scale-pods M`): M pods that hold no GPU on a kwok node (the cluster's other work) and N
running TrainingSpecs; each operator tree given with `--tree LABEL=PATH` (e.g. the code before a change, from
`git worktree add`) runs cluster-wide against them in turn, through the counting proxy. Once its first tick ran
(kopf runs no handler before its watches delivered every pod), a window of `--window-ticks` elastic ticks
(counted by the operator's own metric) measures its CPU seconds, RSS, API requests (and bytes read) per tick
and per second; each tree's result is also printed as soon as it is measured. Cluster-wide operators act on every namespace: run this
part on a rig of its own (tests/rig: KILN_CACHE_DIR and KILN_RIG_PORT_OFFSET), never on a shared one.

    python -m tests.bench.bench_operator [--count 200] [--count-calls 20] [--out runs/bench/operator.json]
        [--tree before=/tmp/old --tree after=. [--rounds 2]] [--scale-runs 100 --scale-pods 20000]

With several trees the burst and the call count run each tree's operator in turn (`--rounds` times for the
burst, a reference between every two bursts): a before/after comparison on one machine at one time.

The burst's runs are created suspended, so no pod or GPU is involved: this measures the operator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import urllib3
import yaml
from aiohttp import web
from kubernetes import client, config as kconfig, watch
from kubernetes.client.exceptions import ApiException

from kiln.api.load import dump_for_apply, parse
from kiln.control.kube import Kube, api_client, object_path
from kiln.control.plan import plan
from kiln.control.job_state import job_condition
from tests.bench.report import write_report
from tests.support.ranks import wait_until


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


RIG_PARTS = ("kube-apiserver", "etcd", "training-operator")


def rig_cpu() -> dict[str, float]:
    """CPU seconds used so far by the rig's apiserver, etcd and training-operator (from the rig's state.json):
    what a client costs the control plane, beside what it costs itself."""
    from tests.rig import cluster

    procs = json.loads((cluster.run_dir() / "state.json").read_text())["procs"]
    return {part: cpu_s(procs[part]["pid"]) for part in RIG_PARTS if part in procs}


def cpu_used(before: dict[str, float], after: dict[str, float], runs: int) -> dict[str, float]:
    """ms of CPU per run by part, from two rig_cpu() readings (with 'client' when the caller adds its own)."""
    return {part: round(1000 * (after[part] - before[part]) / runs, 1) for part in before}


class JobWatcher:
    """Records when each PyTorchJob of a namespace is first seen by a watch."""

    def __init__(self, kube: Kube, namespace: str):
        self.seen: dict[str, float] = {}
        self.errors: list[str] = []  # watches cut (each followed by a new one)
        self.kube, self.namespace = kube, namespace
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        w = watch.Watch()
        while not self._stop.is_set():
            try:
                for event in w.stream(self.kube.custom.list_namespaced_custom_object, "kubeflow.org", "v1",
                                      self.namespace, "pytorchjobs", timeout_seconds=5):
                    name = event["object"]["metadata"]["name"]
                    self.seen.setdefault(name, time.monotonic())
                    if self._stop.is_set():
                        break
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as err:
                # a loaded apiserver cut the watch: watch again (a new watch lists what exists first); before,
                # the thread ended here and the burst waited for jobs long made until its safety timeout
                self.errors.append(f"{type(err).__name__}: {err}"[:200])

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
        self.bytes_read = 0  # response bytes of those calls
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
        watching = request.query.get("watch") in ("true", "1")
        if watching:
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
                    if not watching:
                        self.bytes_read += len(chunk)
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionError):  # the operator stopped mid-watch
                pass
            return resp

    def wait_watching(self, alive, kinds: tuple[str, ...] = ("trainingspecs", "pytorchjobs")) -> None:
        """Until the operator behind this proxy watches each kind: a spec created before its watch opens
        reaches the operator by a list instead."""
        wait_until(f"the operator's watches on {', '.join(kinds)}", alive=alive, cond=lambda: all(
            any(p.endswith("/" + kind) for p in self.watches) for kind in kinds))

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


def create_all(runs: dict[str, list[dict]], create) -> dict[str, float]:
    """Create each run's objects in order, 16 runs at a time; returns run → when its first request was sent."""
    started: dict[str, float] = {}

    def one(run):
        started[run] = time.monotonic()
        for body in runs[run]:
            create(body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, runs))
    return started


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
    return create_all({b["metadata"]["name"]: [b] for b in bodies}, lambda b: create(kube, b))


def create(kube: Kube, obj: dict) -> None:
    """POST one object of a kind kiln writes (kiln.control.kube.PLURALS) to its collection. A kept-alive
    connection the loaded apiserver closed is no answer: sent again (409: the first one did create it)."""
    for attempt in range(3):
        try:
            released(kube.api.call_api(object_path(obj).rsplit("/", 1)[0], "POST",
                                       header_params={"Content-Type": "application/json"}, body=obj,
                                       auth_settings=["BearerToken"], _preload_content=False,
                                       _return_http_data_only=True))
            return
        except urllib3.exceptions.ProtocolError:
            if attempt == 2:
                raise
        except ApiException as err:
            if err.status != 409 or not attempt:
                raise
            return


def released(response) -> None:
    """Read a raw response to its end and hand its connection back (else each request keeps a socket open)."""
    response.data
    response.release_conn()


def reference_objects(namespace: str, count: int) -> dict[str, list[dict]]:
    """Per run, what the operator writes for it (kiln.control.plan), the PyTorchJob last, as the operator does."""
    runs = {}
    for i in range(count):
        doc = parse(spec(f"run-{i}"))
        doc.metadata.namespace = namespace
        runs[doc.metadata.name] = plan(doc).objects
    return runs


def unsettled(kube: Kube, namespace: str, names: list[str]) -> list[str]:
    """The runs not settled yet: a suspended run is settled once the training-operator has marked its job
    Suspended and the run's status shows phase Suspended with its spec accepted at its generation."""
    jobs = {j["metadata"]["name"]: j for j in kube.custom.list_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs")["items"]}
    runs = {r["metadata"]["name"]: r for r in kube.custom.list_namespaced_custom_object(
        "kiln.dev", "v1alpha1", namespace, "trainingspecs")["items"]}

    def settled(name: str) -> bool:
        job, run = jobs.get(name), runs.get(name) or {}
        status = run.get("status") or {}
        accepted = next((c for c in status.get("conditions") or [] if c["type"] == "SpecAccepted"), {})
        return job_condition(job) == "Suspended" and status.get("phase") == "Suspended" and \
            accepted.get("status") == "True" and accepted.get("observedGeneration") == run["metadata"]["generation"]
    return [n for n in names if not settled(n)]


def settle(kube: Kube, op, namespace: str, names: list[str]) -> None:
    """Wait until every run is settled (`unsettled`) and then ticked once more (op: a running operator,
    tests.support.operator.Operator, whose metrics count its ticks' status refreshes):
    whatever the training-operator's marking or a tick would write for the runs is written by then. Every
    run ticks once per TICK_S, so the next len(names) ticks are one of each."""
    alive = lambda: op.proc.poll() is None  # noqa: E731
    left = list(names)

    def all_settled() -> bool:
        left[:] = unsettled(kube, namespace, left)
        return not left
    wait_until("every run's job Suspended and its status showing it", all_settled, alive=alive,
               context=lambda: f"unsettled, e.g. {left[:3]}")
    ticked = op.reconciles("status")
    wait_until(f"{len(names)} more ticks", lambda: op.reconciles("status") >= ticked + len(names), alive=alive)


def count_calls(rig, kube: Kube, namespace: str, count: int, tree: Path, log: Path) -> dict:
    """Every request an operator makes for `count` new TrainingSpecs, until the runs settle.

    The window opens when the specs are created (the operator's watches being open) and closes once every
    run is settled and has ticked once more (`settle`): it holds each run's reconcile, the status refreshes
    its PyTorchJob's events trigger and its first periodic tick (TICK_S after the run was first seen) —
    what a burst costs per run. Not a fixed time, which a slow machine overruns (cutting the count short)
    and a fast one pads. `window_s` says how long it was.
    """
    from tests.support.operator import Operator

    proxy = CountingProxy(rig.kubeconfig)
    op = Operator(proxy.kubeconfig(log.with_suffix(".kubeconfig")), namespace, log,
                  env={"PYTHONPATH": str(tree / "operator")})
    op.start()  # returns once /healthz answers
    alive = lambda: op.proc.poll() is None  # noqa: E731
    try:
        proxy.wait_watching(alive)
        watcher = JobWatcher(kube, namespace)
        try:
            t0 = time.monotonic()
            created = create_specs(kube, namespace, specs(namespace, count))
            watcher.wait(list(created), alive=alive)
            jobs_at = max(watcher.seen.values())
        finally:
            watcher.stop()
        settle(kube, op, namespace, list(created))
        t1 = time.monotonic()
        window = [c for c in proxy.calls if t0 <= c[0] <= t1]
    finally:
        op.stop()
    until_jobs = [c for c in window if c[0] <= jobs_at]
    kinds = Counter(call_kind(m, path) for _, m, path in window)
    return {"specs": count, "per_spec": len(window) / count, "per_spec_until_all_jobs_exist": len(until_jobs) / count,
            "by_kind_per_spec": {k: round(v / count, 2) for k, v in kinds.most_common()},
            "trainingspec_writes_per_spec": trainingspec_writes(window) / count, "window_s": t1 - t0}


def trainingspec_writes(calls: list[tuple[float, str, str]]) -> int:
    """How many of these requests wrote a TrainingSpec (its status, or the object: kopf's annotations)."""
    return sum(1 for _, method, path in calls if method in ("PATCH", "PUT", "POST") and "/trainingspecs" in path)


# ---- what each kind of request costs the control plane ----

def request_costs(kube: Kube, namespace: str, count: int) -> dict:
    """Apiserver, etcd and training-operator CPU ms per request, by the requests a burst is made of, each kind
    sent `count` times from 16 threads (on the objects of `count` runs, in this order: creating them first).
    The rig's background work counts in too: compare the kinds with each other, measured in one run."""
    bodies = specs(namespace, count)
    runs = reference_objects(namespace, count)
    names = [b["metadata"]["name"] for b in bodies]
    kinds = [
        ("POST TrainingSpec", lambda n: create(kube, bodies[names.index(n)])),
        ("GET TrainingSpec", lambda n: kube.trainingspec(namespace, n)),
        ("merge-PATCH TrainingSpec annotations (kopf's)", lambda n: kube.patch_annotations(
            namespace, n, {"bench.kiln.dev/at": str(time.monotonic())})),
        ("merge-PATCH TrainingSpec status", lambda n: kube.patch_status(
            namespace, n, {"step": int(time.monotonic() * 1000)})),
        ("GET a missing PyTorchJob (404)", lambda n: kube.job(namespace, n)),
        ("GET a missing ServiceAccount (404)", lambda n: kube.read(runs[n][0])),
        ("apply ServiceAccount", lambda n: kube.apply(runs[n][0])),
        ("apply ConfigMap", lambda n: kube.apply(next(o for o in runs[n] if o["kind"] == "ConfigMap"))),
        ("apply PyTorchJob", lambda n: kube.apply(runs[n][-1])),
    ]
    result = {}
    for kind, send in kinds:
        before, t0 = rig_cpu(), time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(send, names))
        result[kind] = {**cpu_used(before, rig_cpu(), count), "wall_s": round(time.monotonic() - t0, 2)}
    return result


# ---- the periodic tick at scale: running runs among many pods, one operator tree after another ----

BENCH_NODE = "kwok-bench-pods"


def pods_node() -> dict:
    """A kwok node for the background pods: no GPU, room for any number of pods."""
    room = {"cpu": "100000", "memory": "100Ti", "pods": "1000000"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": BENCH_NODE, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": BENCH_NODE}},
            "status": {"capacity": room, "allocatable": room}}


def background_pod(namespace: str, i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"bg-{i}", "namespace": namespace, "labels": {"app": "bench-background"}},
            "spec": {"nodeName": BENCH_NODE, "containers": [
                {"name": "c", "image": "registry.invalid/bench:1", "resources": {"requests": {"cpu": "1m"}}}]}}


def running_spec(namespace: str, name: str) -> dict:
    """A run that is not suspended: its job exists and every tick of it does the whole elastic pass."""
    doc = parse({**spec(name), "spec": {**spec(name)["spec"], "suspend": False, "scheduling": {"gang": False}}})
    doc.metadata.namespace = namespace
    return dump_for_apply(doc)


def pods_stored(kube: Kube) -> int:
    """Pods the apiserver holds (its apiserver_storage_objects gauge: no list of them needed)."""
    text = released_text(kube.api.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False,
                                           _return_http_data_only=True))
    return int(next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("apiserver_storage_objects{") and 'resource="pods"' in line))


def released_text(response) -> str:
    text = response.data.decode()
    response.release_conn()
    return text


def metric(port: int, name: str, labels: str) -> float:
    """The sum of a counter's series whose labels contain `labels` (e.g. 'handler="elastic"')."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and labels in line)


class TreeOperator:
    """`kiln operator` of one source tree (PYTHONPATH=<tree>/operator), cluster-wide, through a counting proxy."""

    def __init__(self, tree: Path, kubeconfig: Path, log: Path, lease: str):
        from tests.support.ranks import free_port

        self.health, self.metrics = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(tree / "operator"), "PYTHONUNBUFFERED": "1",
               "KILN_TRAINER_IMAGE": "kiln-trainer:rig", "KILN_METRICS_PORT": str(self.metrics)}
        env.pop("KUBECONFIG", None)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.cli.main", "operator", "--kubeconfig", str(kubeconfig),
                 "--health-port", str(self.health), "--leader-lease", lease],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tree)
        self.alive = lambda: self.proc.poll() is None
        wait_until("the operator's metrics", lambda: self._ticks() is not None, alive=self.alive)

    def _ticks(self) -> float | None:
        try:
            return metric(self.metrics, "kiln_operator_reconciles_total", 'handler="elastic"')
        except OSError:
            return None

    def ticks(self) -> float:
        return self._ticks() or 0.0

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure_tree(rig, kube: Kube, tree: Path, namespace: str, runs: int, window_ticks: int, log: Path) -> dict:
    """Start the tree's operator; once every run has its job and the first tick ran, count a window of ticks."""
    from kiln.control.ticks import TICK_S

    proxy = CountingProxy(rig.kubeconfig)
    start = time.monotonic()
    op = TreeOperator(tree, proxy.kubeconfig(log.with_suffix(".kubeconfig")), log, f"default/bench-{tree.name}")
    try:
        def jobs() -> int:
            return len(kube.custom.list_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs")
                       ["items"])
        # started: its watches have delivered every pod (kopf runs no handler before its indexes are full),
        # which takes minutes with many pods on a loaded machine
        wait_until(f"{runs} PyTorchJobs", lambda: jobs() >= runs, alive=op.alive, timeout=3600)
        wait_until("the first elastic tick", lambda: op.ticks() >= 1, alive=op.alive, timeout=3600)
        ready_s, startup_cpu = time.monotonic() - start, cpu_s(op.proc.pid)
        t0, cpu0, ticks0, calls0, bytes0 = time.monotonic(), cpu_s(op.proc.pid), op.ticks(), len(proxy.calls), \
            proxy.bytes_read
        pods0 = pods_stored(kube)
        wait_until(f"{window_ticks} more elastic ticks", lambda: op.ticks() >= ticks0 + window_ticks, alive=op.alive,
                   timeout=3600)
        t1, cpu1, ticks1 = time.monotonic(), cpu_s(op.proc.pid), op.ticks()
        pods1 = pods_stored(kube)
        window = proxy.calls[calls0:]
        read = proxy.bytes_read - bytes0
        errors = metric(op.metrics, "kiln_operator_reconciles_total", 'handler="elastic",outcome="error"')
        rss, peak = rss_kib(op.proc.pid, "VmRSS"), rss_kib(op.proc.pid, "VmHWM")
    finally:
        op.stop()
    ticks, secs = ticks1 - ticks0, t1 - t0
    kinds = Counter(call_kind(m, path) for _, m, path in window)
    result = {"pods_in_cluster": [pods0, pods1], "startup_s": ready_s, "startup_cpu_s": startup_cpu, "window_s": secs, "ticks": ticks,
            "tick_errors_total": errors, "cpu_s": cpu1 - cpu0, "cpu_ms_per_tick": 1000 * (cpu1 - cpu0) / ticks,
            "cpu_cores_busy": (cpu1 - cpu0) / secs, "requests": len(window), "requests_per_s": len(window) / secs,
            "requests_per_tick": len(window) / ticks, "mib_read_per_tick": read / ticks / 2**20,
            "by_kind_per_tick": {k: round(v / ticks, 3) for k, v in kinds.most_common()},
            "rss_mib": rss / 1024, "peak_rss_mib": peak / 1024,
            # what every run ticking every TICK_S would ask of the apiserver (the measured rate is lower when
            # the operator cannot keep up)
            "requests_per_s_at_tick_period": len(window) / ticks * runs / TICK_S}
    print(f"{tree}: {json.dumps(result)}", file=sys.stderr, flush=True)  # kept even if a later part fails
    return result


def create_pod(kube: Kube, namespace: str, i: int) -> None:
    try:
        released(kube.core.create_namespaced_pod(namespace, background_pod(namespace, i), _preload_content=False))
    except ApiException as err:
        if err.status != 409:  # there already: a run that was interrupted left it
            raise


def scale(rig, kube: Kube, trees: dict[str, Path], runs: int, pods: int, window_ticks: int, out: Path,
          ns_pods: str | None = None, load: dict | None = None) -> dict:
    """`runs` running TrainingSpecs among `pods` other pods (in ns_pods, made or topped up); each tree's operator
    measured in turn. Everything is deleted afterwards, also when a measurement failed: the node once its pods
    are gone (kwok finishes their graceful deletion only while it manages the node). load["end"]: the load
    average once the trees were measured, before that cleanup."""
    ns_runs = f"bench-scale-runs-{uuid.uuid4().hex[:5]}"
    ns_pods = ns_pods or f"bench-scale-pods-{uuid.uuid4().hex[:5]}"
    # A cluster-wide operator ticks every TrainingSpec: the burst's (being deleted) must be gone first.
    wait_until("no TrainingSpec left in the cluster", lambda: not kube.trainingspecs(None))
    try:
        for ns in (ns_pods, ns_runs):
            rig.kubectl("create", "namespace", ns, check=False)  # ns_pods may exist (given)
        rig.apply(pods_node())
        t0 = time.monotonic()
        there = {p.metadata.name for p in kube.core.list_namespaced_pod(ns_pods).items}
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: create_pod(kube, ns_pods, i), (i for i in range(pods) if f"bg-{i}" not in there)))
        pods_s = time.monotonic() - t0
        create_specs(kube, ns_runs, [running_spec(ns_runs, f"run-{i}") for i in range(runs)])
        results = {label: measure_tree(rig, kube, tree, ns_runs, runs, window_ticks,
                                       out.with_suffix(f".scale-{label}.log"))
                   for label, tree in trees.items()}
        if load is not None:
            load["end"] = os.getloadavg()
    finally:
        for ns in (ns_pods, ns_runs):
            rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        wait_until("the scale part's pods deleted", lambda: not kube.core.list_pod_for_all_namespaces(
            label_selector="app=bench-background", limit=1).items, timeout=3600)
        rig.kubectl("delete", "node", BENCH_NODE, "--wait=false", check=False)
    first, *rest = trees
    return {"runs": runs, "pods": pods, "window_ticks": window_ticks, "pods_created_in_s": pods_s, "trees": {
        label: {**results[label], "tree": str(trees[label])} for label in trees},
        "ratios_to_" + first: {label: {k: results[label][k] / max(results[first][k], 1e-9) for k in (
            "cpu_ms_per_tick", "cpu_cores_busy", "requests_per_s", "requests_per_tick", "mib_read_per_tick",
            "rss_mib", "peak_rss_mib")} for label in rest}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="TrainingSpecs in the burst (0: skip)")
    parser.add_argument("--count-calls", type=int, default=20, help="TrainingSpecs for the API-call count (0: skip)")
    parser.add_argument("--request-costs", type=int, default=0,
                        help="control-plane CPU per request kind, each sent this many times (0: skip)")
    parser.add_argument("--scale-runs", type=int, default=0, help="running TrainingSpecs for the scale part (0: skip)")
    parser.add_argument("--scale-pods", type=int, default=20000, help="pods besides them (scale part)")
    parser.add_argument("--window-ticks", type=int, default=100, help="elastic ticks measured per tree (scale part)")
    parser.add_argument("--scale-pods-namespace", help="make or top up the pods there (default: a new namespace)")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="an operator source tree, in order (default: after=this checkout); the burst and the "
                             "call count run each tree's operator in turn")
    parser.add_argument("--rounds", type=int, default=1, help="bursts of each tree, taking turns")
    parser.add_argument("--out", default="runs/bench/operator.json")
    args = parser.parse_args(argv)
    trees = {label: Path(path).resolve() for label, path in (t.split("=", 1) for t in args.tree)} or {
        "after": Path(__file__).resolve().parents[2]}

    from tests.rig.install import install_crd
    from tests.rig import cluster

    rig, started = cluster.up(lease_pid=os.getpid())
    load = {"start": os.getloadavg()}  # the machine is shared: say how busy it was
    namespaces: list[str] = []

    def namespace(kind: str) -> str:
        namespaces.append(name := f"bench-{kind}-{uuid.uuid4().hex[:5]}")
        rig.kubectl("create", "namespace", name)
        return name

    calls = scaled = costs = None
    result: dict = {}
    try:
        install_crd(rig)
        kube = Kube(api_client(str(rig.kubeconfig)))
        if args.count:
            result = bursts(rig, kube, args, trees, namespace)
        if args.count_calls:
            calls = {label: count_calls(rig, kube, namespace("calls"), args.count_calls, tree,
                                        Path(args.out).with_suffix(f".calls-{label}.log"))
                     for label, tree in trees.items()}
        if args.request_costs:
            costs = request_costs(kube, namespace("costs"), args.request_costs)
        for ns in namespaces:  # the scale part's cluster-wide operators would tick these runs too
            rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if args.scale_runs:  # last: it waits for its pods' deletion before it returns
            scaled = scale(rig, kube, trees, args.scale_runs, args.scale_pods, args.window_ticks, Path(args.out),
                           args.scale_pods_namespace, load)
        load.setdefault("end", os.getloadavg())
    finally:
        for ns in namespaces:
            rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.release(os.getpid(), stop_if_unused=started)
    write_report({**result, "api_calls": calls, "request_costs_cpu_ms": costs, "scale": scaled,
                  "load_avg_1_5_15": load}, args.out)
    return 0


def reference(kube: Kube, namespace: str, count: int) -> dict:
    """The reference: a client creating what the operator writes per run, the same way (16 runs at a time)."""
    watcher = JobWatcher(kube, namespace)
    try:
        objects = reference_objects(namespace, count)
        rig0, t0 = {**rig_cpu(), "client": time.process_time()}, time.monotonic()
        created = create_all(objects, lambda b: create(kube, b))
        watcher.wait(list(created))
        total = max(watcher.seen.values()) - t0
        cpu = cpu_used(rig0, {**rig_cpu(), "client": time.process_time()}, count)
    finally:
        watcher.stop()
    lat = latencies(created, watcher.seen, {n: n for n in created})
    return {"p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "all_jobs_exist_after_s": total,
            # 'client': this process (the 16 creating threads and the job watch)
            "cpu_ms_per_run": cpu, "job_watches_cut": len(watcher.errors)}


def bursts(rig, kube: Kube, args, trees: dict[str, Path], namespace) -> dict:
    """`args.count` TrainingSpecs at once, by each tree's operator in turn (`args.rounds` times), against the
    reference client (see the module's docstring), which runs before the first burst and after each one: on a
    shared machine the load moves within minutes, and each burst is compared with the mean of the two
    references around it. namespace(kind): a new namespace (deleted by the caller)."""
    ref, runs = reference(kube, namespace("ref"), args.count), []
    for turn in range(args.rounds):
        for label, tree in trees.items():
            kiln = burst(rig, kube, args, namespace("kiln"), tree, Path(args.out).with_suffix(f".{label}.log"))
            after = reference(kube, namespace("ref"), args.count)
            runs.append({"tree": label, "round": turn, **compare(kiln, ref, after), "load_1m": os.getloadavg()[0]})
            ref = after
    by_tree = {label: {k: [r[k] for r in runs if r["tree"] == label] for k in ("ratio_all_jobs_exist", "ratio_p99")}
               for label in trees}
    for summary in by_tree.values():
        summary["median_ratio_all_jobs_exist"] = statistics.median(summary["ratio_all_jobs_exist"])
    return {"count": args.count, "bursts": runs, "by_tree": by_tree}


def burst(rig, kube: Kube, args, namespace: str, tree: Path, log: Path) -> dict:
    """One burst: the operator of `tree` started, warmed up, then `args.count` TrainingSpecs at once."""
    from tests.support.operator import Operator

    op = Operator(rig.kubeconfig, namespace, log, env={"PYTHONPATH": str(tree / "operator")})
    try:
        op.start()  # returns once /healthz answers
        alive = lambda: op.proc.poll() is None  # noqa: E731
        watcher = JobWatcher(kube, namespace)
        try:
            # ready = its first reconcile done (watches open, handlers imported): one run's PyTorchJob exists
            warm = specs(namespace, 1)[0]
            warm["metadata"]["name"] = "warm-up"
            create_specs(kube, namespace, [warm])
            watcher.wait(["warm-up"], alive=alive)
            idle_rss = rss_kib(op.proc.pid, "VmRSS")
            cpu0 = cpu_s(op.proc.pid)
            bodies = specs(namespace, args.count)
            rig0, t0 = {**rig_cpu(), "client": cpu0}, time.monotonic()
            created = create_specs(kube, namespace, bodies)
            watcher.wait(list(created), alive=alive)
            total = max(watcher.seen.values()) - t0
            peak_rss = rss_kib(op.proc.pid, "VmHWM")
            op_cpu = cpu_s(op.proc.pid) - cpu0
            cpu = cpu_used(rig0, {**rig_cpu(), "client": cpu0 + op_cpu}, args.count)
        finally:
            watcher.stop()
    finally:
        op.stop()
    lat = latencies(created, watcher.seen, {n: n for n in created})
    return {"p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "mean_s": statistics.mean(lat),
            "all_jobs_exist_after_s": total, "runs_per_s": args.count / total,
            # the operator's own CPU until the last job existed, per run: less sensitive than the times
            # to whatever else shares the machine
            "operator_cpu_ms_per_run": 1000 * op_cpu / args.count,
            # until the last job existed, per run: the operator ('client') and the control plane
            "cpu_ms_per_run": cpu, "job_watches_cut": len(watcher.errors),
            "operator_rss_mib": {"idle": idle_rss / 1024, "peak": peak_rss / 1024,
                                 "peak_over_idle": peak_rss / max(idle_rss, 1)}}


def compare(kiln: dict, *refs: dict) -> dict:
    """A burst against the mean of the references around it."""
    ref = {k: statistics.mean(r[k] for r in refs) for k in ("p50_s", "p99_s", "all_jobs_exist_after_s")}
    return {"kiln": kiln, "reference_same_objects": {**ref, "runs": list(refs)},
            "ratio_p50": kiln["p50_s"] / ref["p50_s"], "ratio_p99": kiln["p99_s"] / ref["p99_s"],
            "ratio_all_jobs_exist": kiln["all_jobs_exist_after_s"] / ref["all_jobs_exist_after_s"]}


if __name__ == "__main__":
    sys.exit(main())
