"""The page users look at: a run tracked by kiln into a real MLflow server (tests/mlflow_server.py), opened in
headless Chromium (Debian's `chromium`) as a person would open it. The page must show the loss curve: the
screenshot has the curve's pixels (an empty or still-loading chart has none), and MLflow's REST API holds every
step. The screenshot is kept in runs/test-artifacts/ for a person to look at."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from kiln.trainer.observe.tracking import MlflowTracker, Tracking
from tests import mlflow_server

pytestmark = [pytest.mark.tools, pytest.mark.slow]
ARTIFACTS = Path(__file__).resolve().parents[2] / "runs" / "test-artifacts"
STEPS = 30


def loss(step: int) -> float:
    return 5.0 / (1 + 0.2 * step)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    server = mlflow_server.start(tmp_path_factory.mktemp("mlflow-page"))
    try:
        tracking = Tracking([MlflowTracker(server.uri, "page", "page-run")], params={"training.lr": "0.001"})
        for step in range(1, STEPS + 1):
            tracking.offer({"step": step, "loss": loss(step), "lr": 0.001})
        tracking.close()
        assert tracking.errors == {} and tracking.dropped == 0
        yield server
    finally:
        server.stop()


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "this test opens the MLflow UI in Debian's headless Chromium: apt-get install chromium"
    return found


def open_page(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1400,900", "--virtual-time-budget=60000", *args, url],
                          capture_output=True, timeout=300, check=True)


def test_the_loss_curve_of_a_tracked_run_is_on_its_mlflow_page(tracked):
    from PIL import Image

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracked.uri)  # MLflow's REST API
    experiment = client.get_experiment_by_name("page").experiment_id
    run = client.search_runs([experiment])[0].info.run_id
    history = client.get_metric_history(run, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))

    url = (f"{tracked.uri}/#/metric?runs={urllib.parse.quote(json.dumps([run]))}&metric=%22loss%22"
           f"&experiments={urllib.parse.quote(json.dumps([experiment]))}"
           f"&plot_metric_keys={urllib.parse.quote(json.dumps(['loss']))}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "mlflow-loss-curve.png"
    open_page(url, f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    # The chart (right of its controls, left of the assistant panel) is grey grid and text on white; the curve is
    # the one saturated colour there (MLflow picks it per run). An empty, failed or still-loading chart has none.
    chart = image.crop((375, 110, 1010, 460))
    curve = sum(1 for r, g, b in chart.getdata() if max(r, g, b) - min(r, g, b) > 60)
    assert curve > 300, f"no loss curve on the page ({curve} curve pixels); see {shot}"
    print(f"screenshot: {shot}")
