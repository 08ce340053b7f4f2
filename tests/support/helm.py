"""The Helm chart and the kustomize install on the rig: the operator run from a rendered Deployment, with its
command and arguments, and one sample reconciled through it, read from its metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ranks import SAFETY_TIMEOUT_S, free_port, wait_until


REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
SAMPLE = MANIFESTS / "samples" / "quickstart.yaml"
OPERATOR_DOCKERFILE = REPO / "images" / "operator" / "Dockerfile"


def entrypoint() -> list[str]:
    line = [l for l in OPERATOR_DOCKERFILE.read_text().splitlines() if l.startswith("ENTRYPOINT ")][-1]
    return json.loads(line.split(None, 1)[1])


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=3) as r:
        return r.status, r.read().decode()


@contextmanager
def operator_from_deployment(deployment: dict, kubeconfig: Path, log: Path, extra_args: tuple[str, ...] = ()):
    """Run what the Deployment runs, out of cluster: the image's entrypoint, the container's args and env
    (ports moved to free ones), authenticated by `kubeconfig`. Yields (health_url, metrics_url)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    health, metrics = free_port(), free_port()
    # the downward API as the kubelet fills it in (the pod's name is the Deployment's here)
    pod = {"metadata.namespace": deployment["metadata"]["namespace"], "metadata.name": deployment["metadata"]["name"]}
    env = {e["name"]: e["value"] if "value" in e else pod.get(e["valueFrom"].get("fieldRef", {}).get("fieldPath"), "")
           for e in container.get("env", [])}
    env.update(KILN_HEALTH_PORT=str(health), KILN_METRICS_PORT=str(metrics), PYTHONUNBUFFERED="1",
               KUBECONFIG=str(kubeconfig))
    program, *rest = entrypoint()
    cmd = [shutil.which(program), *rest, "--kubeconfig", str(kubeconfig), *container.get("args", []), *extra_args]
    probe = container["readinessProbe"]["httpGet"]["path"]
    health_url, metrics_url = f"http://127.0.0.1:{health}{probe}", f"http://127.0.0.1:{metrics}/metrics"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        def healthy() -> bool:
            try:
                return get(health_url)[0] == 200
            except OSError:
                return False
        wait_until(health_url, healthy, alive=lambda: proc.poll() is None, context=lambda: log.read_text()[-4000:])
        yield health_url, metrics_url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(url: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(get(url)[1]) for s in family.samples}


def reconcile_sample(rig, namespace: str, metrics_url: str) -> dict:
    """Create the quickstart sample in `namespace`; return its PyTorchJob once the operator made it."""
    rig.kubectl("apply", "-n", namespace, "-f", str(SAMPLE))
    name = yaml.safe_load(SAMPLE.read_text())["metadata"]["name"]

    def job():
        proc = rig.kubectl("get", "pytorchjob", name, "-n", namespace, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    pytorchjob = rig.wait_for(f"PyTorchJob {namespace}/{name}", job, timeout=SAFETY_TIMEOUT_S)
    samples = rig.wait_for("the reconcile in the operator's metrics", lambda: (
        s := scrape(metrics_url)).get(("kiln_operator_reconciles_total", (("handler", "spec"), ("outcome", "ok"))))
        and s, timeout=SAFETY_TIMEOUT_S)
    # The run counts once, in whatever phase it has reached by now.
    counted = {dict(labels)["phase"]: v for (metric, labels), v in samples.items()
               if metric == "kiln_operator_trainingspecs" and dict(labels)["namespace"] == namespace}
    assert sum(counted.values()) == 1, counted
    return pytorchjob
