"""The page users look at: a run tracked by kiln into a real MLflow server (tests/mlflow_server.py), opened in
headless Chromium (Debian's `chromium`) as a person would open it. The page must show the loss curve: the chart
is found in the page's DOM after its scripts ran (Chromium's --dump-dom; Plotly's SVG), and every point it plots
is, read back through the chart's own y axis, a loss MLflow's REST API holds, from the first step's to the last's.
A screenshot of the same page is kept in runs/test-artifacts/ for a person to look at."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
from html.parser import HTMLParser
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
        tracking.close(timeout=600)  # returns once sent: the bound is for a server that never answers
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


class PlotlyChart(HTMLParser):
    """The first Plotly chart of a page's DOM: its first line trace's vertices (`path.js-line`), the y axis' tick
    labels with their positions (`g.ytick > text`), and the plot area's offset (`g.xy` translate)."""

    def __init__(self):
        super().__init__()
        self.in_chart = False
        self.groups: list[str] = []  # classes of the open <g> elements
        self.line: str | None = None
        self.yticks: list[tuple[float, float]] = []  # (value, y)
        self.plot_dy: float | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if "js-plotly-plot" in cls:
            self.in_chart = True
        if not self.in_chart:
            return
        if tag == "g":
            self.groups.append(a.get("class") or "")
            if cls == ["xy"] and a.get("transform") and self.plot_dy is None:
                self.plot_dy = translate(a["transform"])[1]
        elif tag == "path" and "js-line" in cls and self.line is None:
            self.line = a["d"]
        elif tag == "text" and self.groups and self.groups[-1] == "ytick":
            self.yticks.append((float(a["data-unformatted"]), translate(a.get("transform") or "translate(0,0)")[1]))

    def handle_endtag(self, tag):
        if tag == "g" and self.in_chart and self.groups:
            self.groups.pop()

    def points(self) -> list[tuple[float, float]]:
        """(x pixel, value read on the y axis) of each vertex of the line, in the chart's own scale."""
        (v0, y0), (v1, y1) = self.yticks[0], self.yticks[-1]
        per_px = (v1 - v0) / (y1 - y0)
        vertices = [tuple(map(float, xy.split(","))) for xy in re.findall(r"[-\d.e]+,[-\d.e]+", self.line)]
        return [(x, v0 + (y + self.plot_dy - y0) * per_px) for x, y in vertices]


def translate(transform: str) -> tuple[float, float]:
    x, _, y = re.search(r"translate\(([^)]*)\)", transform).group(1).partition(",")
    return float(x), float(y or 0)


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
    assert Image.open(shot).size == (1400, 900)  # kept for a person to look at

    chart = PlotlyChart()
    chart.feed(open_page(url, "--dump-dom").stdout.decode())
    assert chart.line is not None and len(chart.yticks) >= 2 and chart.plot_dy is not None, \
        f"no loss chart in the page's DOM; see {shot}"
    plotted = chart.points()
    # Plotly leaves out points on a straight run of the line, so the chart holds a subset: each one a logged
    # loss, in step order, from the first step's to the last's (an empty or still-loading chart has no line).
    logged = [m.value for m in sorted(history, key=lambda m: m.step)]
    tolerance = 0.01 * (max(logged) - min(logged))  # a pixel's worth on a chart a few hundred pixels high
    assert len(plotted) >= 2 and [x for x, _ in plotted] == sorted(x for x, _ in plotted)
    at = [min(range(STEPS), key=lambda i, v=v: abs(logged[i] - v)) for _, v in plotted]
    assert all(abs(logged[i] - v) <= tolerance for i, (_, v) in zip(at, plotted)), (plotted, logged)
    assert at == sorted(at) and at[0] == 0 and at[-1] == STEPS - 1, at
    print(f"screenshot: {shot}; {len(plotted)} plotted points")
