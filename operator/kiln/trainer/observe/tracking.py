"""Experiment tracking (`spec.tracking`): rank 0 sends the run's parameters, its logged metrics and its checkpoint
commits to MLflow and/or Weights & Biases, and a step never waits for a tracker.

The loop hands `Tracking.offer` the same record it writes to metrics.jsonl; `offer` puts it on a bounded queue and
returns at once. One thread owns the tracker clients and sends what it takes off the queue. When the queue is full
(a tracker that is down or slow) the record is dropped and counted (`tracking_dropped` in later records); each
tracker's first failure is said once on stderr and carried as `tracking_error` in the records (the status report
and Prometheus read them). Nothing a tracker does can fail the run.

A restarted run continues the same tracked run: the tracker's run id is kept in the run's checkpoint store
(`tracking/<tracker>.json`). A resumed run repeats the steps after its checkpoint bit for bit, so the steps the
tracked run already holds are not sent again: its curves have no duplicated and no missing steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from kiln.errors import KilnError

log = logging.getLogger("kiln.tracking")

RUN_ID_KEY = "tracking/{name}.json"  # in the run's checkpoint store
DEFAULT_CAPACITY = 10_000  # records held while a tracker is slow; about a day of steps at one per 10 s
MAX_PARAM_LEN = 500  # MLflow stores a parameter value of at most 6000 characters; keep the list readable
# The HTTP client's own retries would hold the sender for minutes per record while the server is down; the queue
# and its drop counter are the retry policy here.
MLFLOW_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def flat_params(doc: Any, prefix: str = "") -> dict[str, str]:
    """A spec as flat `a.b.c` → text pairs (lists by index), as trackers show parameters."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = ((str(i), v) for i, v in enumerate(doc))
    else:
        return {prefix: str(doc)[:MAX_PARAM_LEN]} if prefix else {}
    out: dict[str, str] = {}
    for key, value in items:
        out.update(flat_params(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def numeric_metrics(record: dict) -> dict[str, float]:
    """The record's numbers as metric name → value: nested objects one level down as `a.b`; no step, no text."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{k}": float(v) for k, v in value.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def first_line(err: Exception) -> str:
    """An error as one short line (a tracker's messages can hold a whole HTTP response)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


class Tracker(Protocol):
    """One experiment tracker's client; every call runs on the sender thread."""

    name: str

    def open(self, run_id: str | None, params: dict[str, str]) -> str:
        """Create the tracked run (run_id None) or continue it; return its id."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def committed(self, step: int, uri: str) -> None: ...

    def close(self, ok: bool) -> None: ...


class MlflowTracker:
    """An MLflow tracking server through `mlflow.MlflowClient` (no global active run)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.last_step = -1  # the newest step the tracked run holds

    def open(self, run_id: str | None, params: dict[str, str]) -> str:
        for key, value in MLFLOW_HTTP_ENV.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None:
            self.run_id = run_id
            history = self.client.get_metric_history(run_id, "loss")
            self.last_step = max((m.step for m in history), default=-1)
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags={"kiln.run": self.run_name})
        self.run_id = run.info.run_id
        pairs = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(pairs), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=pairs[i:i + 100])
        return self.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.last_step:  # a resumed run repeating steps the tracked run already holds
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-call metric limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        self.last_step = step

    def committed(self, step: int, uri: str) -> None:
        self.client.set_tag(self.run_id, "kiln.last_checkpoint", uri)
        self.client.set_tag(self.run_id, "kiln.last_checkpoint_step", str(step))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class WandbTracker:
    """Weights & Biases through `wandb.init` (mode online or offline: offline writes the run's folder under the
    output directory for a later `wandb sync`)."""

    name = "wandb"

    def __init__(self, project: str, entity: str | None, mode: str, run_name: str, directory: str | None):
        self.project, self.entity, self.mode, self.run_name, self.directory = project, entity, mode, run_name, directory
        self.last_step = -1

    def open(self, run_id: str | None, params: dict[str, str]) -> str:
        import wandb
        from wandb.sdk.lib import runid

        self.run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, name=self.run_name,
                              id=run_id or runid.generate_id(), resume="allow", dir=self.directory,
                              config=params, settings=wandb.Settings(console="off", x_disable_stats=True))
        self.last_step = int(self.run.step) - 1 if run_id and self.run.step else -1
        return self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.last_step:
            return
        self.run.log(metrics, step=step)
        self.last_step = step

    def committed(self, step: int, uri: str) -> None:
        self.run.summary["last_checkpoint"] = uri
        self.run.summary["last_checkpoint_step"] = step

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class Tracking:
    """The bounded queue and the sender thread in front of the trackers (rank 0 only)."""

    def __init__(self, trackers: list[Tracker], *, params: dict[str, str], store=None,
                 capacity: int = DEFAULT_CAPACITY):
        self.trackers, self.store = trackers, store
        self.dropped = 0
        self.errors: dict[str, str] = {}  # tracker → its first failure, said once
        self._dead: set[str] = set()  # trackers whose run could not be opened: nothing more is sent to them
        self._last_commit: int | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._send, args=(params,), name="kiln-tracking", daemon=True)
        self._thread.start()

    # ---- the loop's side: never blocks ----

    def annotate(self, record: dict) -> None:
        """Note in a step's record the drops so far and each tracker's first failure (metrics.jsonl, status.tracking
        and Prometheus read them)."""
        if self.dropped:
            record["tracking_dropped"] = self.dropped
        if self.errors:
            record["tracking_error"] = "; ".join(f"{k}: {v}" for k, v in sorted(self.errors.items()))

    def offer(self, record: dict) -> None:
        """Queue a logged record's metrics; drop and count when the queue is full."""
        self._put(("log", record["step"], numeric_metrics(record)))

    def commit(self, last_checkpoint: dict | None) -> None:
        """Queue the newest commit (kiln.trainer.checkpoint's lastCheckpoint), once per step."""
        if last_checkpoint and last_checkpoint.get("step") != self._last_commit:
            self._last_commit = last_checkpoint["step"]
            self._put(("committed", last_checkpoint["step"], last_checkpoint.get("uri", "")))

    def _put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def close(self, ok: bool = True, timeout: float = 30.0) -> None:
        """Send what is queued (up to `timeout` seconds: a run's end never waits longer for a tracker), then end."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put(("close", ok), timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # ---- the sender thread ----

    def _send(self, params: dict[str, str]) -> None:
        for tracker in self.trackers:
            self._call(tracker, self._open, tracker, params)
        while True:
            kind, *args = self._queue.get()
            for tracker in self.trackers:
                if tracker.name not in self._dead:
                    self._call(tracker, getattr(tracker, kind), *args)
            if kind == "close":
                return

    def _open(self, tracker: Tracker, params: dict[str, str]) -> None:
        key = RUN_ID_KEY.format(name=tracker.name)
        known = None
        if self.store is not None and self.store.exists(key):
            known = json.loads(self.store.get_bytes(key, length=4096)).get("run_id")
        try:
            run_id = tracker.open(known, params)
        except Exception:
            self._dead.add(tracker.name)
            raise
        if self.store is not None and run_id != known:
            self.store.put_bytes(key, json.dumps({"run_id": run_id}).encode())

    def _call(self, tracker: Tracker, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a tracker never fails the run; its first failure is said once
            if tracker.name not in self.errors:
                self.errors[tracker.name] = said = first_line(e)
                print(f"kiln: tracking: {tracker.name} is not reachable or refused a call ({said}); "
                      "training goes on, records are dropped and counted while it lasts", file=sys.stderr, flush=True)


def start(spec_doc, *, store, output_dir) -> Tracking | None:
    """The run's trackers (rank 0), or None when spec.tracking names none."""
    cfg = spec_doc.spec.tracking
    if cfg is None or (cfg.mlflow is None and cfg.wandb is None):
        return None
    meta = spec_doc.metadata
    run_name = meta.name
    trackers: list[Tracker] = []
    if cfg.mlflow is not None:
        experiment = cfg.mlflow.experiment or (f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name)
        trackers.append(MlflowTracker(cfg.mlflow.uri, experiment, run_name))
    if cfg.wandb is not None:
        trackers.append(WandbTracker(cfg.wandb.project, cfg.wandb.entity, cfg.wandb.mode, run_name,
                                     str(output_dir) if output_dir is not None else None))
    params = flat_params(spec_doc.spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    return Tracking(trackers, params=params, store=store, capacity=cfg.buffer)


# ---- `kiln export --track`: the exported model, logged to the run's tracked run ----------------------------------

EXPORT_ARTIFACT_PATH = "model"  # the folder's place among the MLflow run's artifacts


def tracked_run_id(store, name: str) -> str:
    """The id of the run's tracked run in tracker `name`, as its rank 0 kept it in the checkpoint store."""
    key = RUN_ID_KEY.format(name=name)
    if store is None or not store.exists(key):
        raise KilnError(f"spec.tracking.{name}: the checkpoint store holds no {key}: this run was never tracked "
                        f"in {name}, so there is no tracked run to log the export to")
    try:
        run_id = json.loads(store.get_bytes(key, length=4096)).get("run_id")
    except (ValueError, AttributeError):  # the bucket's content is not trusted: not JSON, or not an object
        run_id = None
    if not isinstance(run_id, str) or not run_id:
        raise KilnError(f"spec.tracking.{name}: {key} in the checkpoint store names no run_id")
    return run_id


@contextlib.contextmanager
def _refusal(name: str, where: str):
    """A tracker's failure while logging an export, as one line naming it."""
    try:
        yield
    except Exception as err:
        raise KilnError(f"spec.tracking.{name}: {where} did not take the export ({first_line(err)})") from None


def log_export(spec_doc, *, store, folder, files: list[str], step: int, fmt: str,
               wandb_dir: str | None = None) -> list[str]:
    """Log an exported model's `files` (keys under the local `folder`) to each tracker of spec.tracking, into the
    run's own tracked run (its id from the checkpoint store): MLflow artifacts under `model/`, a W&B artifact of
    type model. Returns one line per tracker saying where it went. Unlike training, the caller asked for this: a
    failure raises, as one line naming the tracker."""
    cfg = spec_doc.spec.tracking
    if cfg is None or (cfg.mlflow is None and cfg.wandb is None):
        raise KilnError("--track: spec.tracking names no tracker (mlflow or wandb) to log the export to")
    said = []
    if cfg.mlflow is not None:
        run_id = tracked_run_id(store, "mlflow")
        from mlflow.tracking import MlflowClient

        with _refusal("mlflow", cfg.mlflow.uri):
            client = MlflowClient(tracking_uri=cfg.mlflow.uri)
            for key in files:  # the export's own files only, whatever else the folder holds
                where = "/".join([EXPORT_ARTIFACT_PATH, *key.split("/")[:-1]])
                client.log_artifact(run_id, str(Path(folder) / key), artifact_path=where)
            client.set_tag(run_id, "kiln.exported_step", str(step))
            client.set_tag(run_id, "kiln.exported_format", fmt)
        said.append(f"mlflow run {run_id}: artifacts {EXPORT_ARTIFACT_PATH}/ (runs:/{run_id}/{EXPORT_ARTIFACT_PATH})")
    if cfg.wandb is not None:
        run_id = tracked_run_id(store, "wandb")
        import wandb

        with _refusal("wandb", f"project {cfg.wandb.project}"):
            run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, mode=cfg.wandb.mode, id=run_id,
                             resume="allow", dir=wandb_dir,
                             settings=wandb.Settings(console="off", x_disable_stats=True))
            artifact = wandb.Artifact(f"{spec_doc.metadata.name}-model", type="model",
                                      metadata={"step": step, "format": fmt})
            for key in files:
                artifact.add_file(str(Path(folder) / key), name=key)
            run.log_artifact(artifact)
            run.finish()
        said.append(f"wandb run {run_id}: artifact {artifact.name} (type model)")
    return said
