"""A real Prometheus server for the e2e tests, and what kiln promises to show in one.

The server is `cmd/prometheus` of the github.com/prometheus/prometheus Go module (the version promtool is
built from), built once into $KILN_CACHE_DIR/tools without the web UI's assets and with only the file,
HTTP and Kubernetes service discovery. It listens on 127.0.0.1 and finds its targets as a cluster's
Prometheus does: Kubernetes service discovery through the apiserver (the rig's admin kubeconfig), the
operator through its metrics Service's EndpointSlices (what the chart's ServiceMonitor selects) and the
trainer pods by their container port named `metrics` (what a PodMonitor selects); it scrapes the pods'
own addresses on the rig's bridge.

What kiln promises: every query of the shipped Grafana dashboard (helm/kiln/dashboards/kiln.json) and
every alert rule (manifests/monitoring/kiln-alerts.yaml, which the server also loads and evaluates).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.support.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
VERSION = "v0.316.0"  # github.com/prometheus/prometheus: Prometheus 3.x's module version (promtool's too)
DASHBOARD = REPO / "helm" / "kiln" / "dashboards" / "kiln.json"
RULES = REPO / "manifests" / "monitoring" / "kiln-alerts.yaml"
SCRAPE_INTERVAL_S = 2
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 × scrape interval): the second, for a
# range query whose step is the scrape interval
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"


def server() -> Path:
    """The prometheus executable (built on first use: minutes)."""
    from tests.tools import go_installed

    return go_installed("github.com/prometheus/prometheus/cmd/prometheus", VERSION, timeout=2400,
                        tags="remove_all_sd,enable_kubernetes_sd")


def promtool() -> Path:
    from tests.tools import go_installed

    return go_installed("github.com/prometheus/prometheus/cmd/promtool", VERSION, timeout=2400)


def scrape_config(kubeconfig: Path, operator_ns: str, runs_ns: str) -> dict:
    def sd(role: str, ns: str) -> list[dict]:
        return [{"role": role, "kubeconfig_file": str(kubeconfig), "namespaces": {"names": [ns]}}]

    return {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "kiln-operator", "kubernetes_sd_configs": sd("endpointslice", operator_ns),
             "relabel_configs": [
                 {"source_labels": ["__meta_kubernetes_service_label_app_kubernetes_io_component",
                                    "__meta_kubernetes_endpointslice_port_name"],
                  "regex": "operator;metrics", "action": "keep"},
                 {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]},
            {"job_name": "kiln-trainer", "kubernetes_sd_configs": sd("pod", runs_ns),
             "relabel_configs": [
                 {"source_labels": ["__meta_kubernetes_pod_label_kiln_dev_trainingspec",
                                    "__meta_kubernetes_pod_container_port_name"],
                  "regex": ".+;metrics", "action": "keep"},
                 {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                 {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]},
        ],
    }


class Prometheus:
    """A running server and its HTTP API (https://prometheus.io/docs/prometheus/latest/querying/api/)."""

    def __init__(self, exe: Path, workdir: Path, config: dict, start_timeout: float = 120):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()  # released just before the server binds it
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "prometheus.log"
        self.started = time.time()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(exe), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout  # a safety net: readiness is what ends the wait
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict | list:
        """GET /api/v1/<path>; the `data` of a success, an AssertionError naming Prometheus's error otherwise."""
        query = urllib.parse.urlencode([(k, v) for k, vs in params.items()
                                        for v in (vs if isinstance(vs, list) else [vs])])
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=60) as r:
                body = json.load(r)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        assert body["status"] == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=SCRAPE_INTERVAL_S)["result"]

    def shows(self, expr: str, start: float, end: float) -> bool:
        """Whether a graph of `expr` over [start, end] draws anything: a finite value at some step (a
        quantile of no observations is NaN, which Grafana leaves blank)."""
        return any(math.isfinite(float(v)) for series in self.query_range(expr, start, end)
                   for _, v in series["values"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------------- what kiln promises

def dashboard_queries() -> dict[str, str]:
    """{"<panel title> #<n>": expr} for every target of the dashboard, with Grafana's variables as an
    "All" selection fills them in; and its `run` variable's label_values query."""
    board = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in board["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            if target.get("expr"):
                out[f"{panel['title']} #{i}"] = grafana_expr(target["expr"])
    return out


def run_variable(board: dict | None = None) -> tuple[str, str]:
    """The dashboard's `run` variable as (label, metric) of its `label_values(metric, label)` query."""
    board = board or json.loads(DASHBOARD.read_text())
    (var,) = [v for v in board["templating"]["list"] if v["name"] == "run"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"]).groups()
    return label, metric


def grafana_expr(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$run", ".*")


def alert_rules() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
            if "alert" in r}


def selectors(ast: dict) -> list[str]:
    """The vector selectors of a query, from Prometheus's own parse (/api/v1/parse_query), as queries."""
    found = []
    if ast.get("type") in ("vectorSelector", "matrixSelector"):  # a matrix selector carries its vector's matchers
        matchers = ",".join(f'{m["name"]}{m["type"]}{json.dumps(m["value"])}' for m in ast["matchers"])
        found.append(f"{{{matchers}}}")
    for value in ast.values():
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, dict):
                found += selectors(child)
    return found


def metric_name(selector: str) -> str:
    return re.search(r'__name__="(\w+)"', selector).group(1)


# Series that a healthy run on CPU nodes cannot have, and why. For these the test asks instead that kiln
# declares the metric (Prometheus read its HELP/TYPE from the operator's /metrics, or the trainer's exporter
# registers it): the emitter exists, and the panel or rule fills in where the condition holds.
NO_SAMPLES_ON_CPU = {
    "kiln_operator_reconcile_errors_total": "a series per handler and error type from its first failed reconcile; "
                                            "a healthy run has none",
    "kiln_train_mfu": "not reported on CPU: no known peak (kiln.trainer.observe.metrics.mfu_note); GPU runs only",
    "kiln_data_source_share": "runs that mix data.sources only; these runs read one data.uri",
    "kiln_gpu_health": "GPU nodes only (NVML)",
    "kiln_operator_run_cost": "only where the platform set a price for the run's gpuType (KILN_GPU_PRICES); the "
                              "rig's runs request no GPU type",
    "kiln_train_straggler": "a series only for a rank named a straggler; a healthy run has none "
                            "(tests/distributed/test_slow_rank.py names one)",
    **{f"kiln_train_moe_{m}": "mixture-of-experts runs only (model.moe); the rig's runs train a dense model"
       for m in ("balance", "load_cv", "busiest_expert_tokens", "idlest_expert_tokens", "aux_loss", "z_loss")},
}


def family(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum|created)$", "", name)


def declared_families(prom: Prometheus) -> set[str]:
    """Metric families kiln declares: those Prometheus read from its targets (HELP/TYPE, /api/v1/metadata:
    the operator's, still up) and those the trainer's exporter registers (its pods are gone by now)."""
    from prometheus_client import CollectorRegistry

    from kiln.trainer.observe.exporter import TrainerExporter

    trainer = TrainerExporter("declared", registry=CollectorRegistry()).registry
    return {family(n) for n in prom.api("metadata")} | {family(f.name) for f in trainer.collect()}


def excused(selector: str, declared: set[str]) -> bool:
    name = metric_name(selector)
    return name in NO_SAMPLES_ON_CPU and family(name) in declared


if __name__ == "__main__":  # `make rig`: build both before the tests, outside any test's timeout
    print(server(), promtool(), sep="\n")
