"""Trainer rank 0 writes its progress into the TrainingSpec's status subresource (DESIGN.md §1, §4).

The trainer owns step, progress, etaSeconds, tokensPerSecond, mfu, lastCheckpoint, trainerTime (its
cumulative productive, checkpoint-stall and rollback seconds) and gpuHealth (each node's GPU states, from
kiln.trainer.observe.gpu_health; a list, so a merge patch replaces it whole and a node the run left drops out); the
operator owns phase, nodes, conditions, restarts, observedGeneration and goodput, which it computes from
trainerTime and the time no trainer ran (kiln.control.goodput). Both send JSON merge patches, so each side
only ever touches its own keys.

In a pod the operator sets KILN_RUN_NAME and KILN_NAMESPACE and runs the pod as `<run>-trainer`, a
ServiceAccount that may get and patch this one run's status. Without those variables (`kiln run` on a
laptop) the reporter sends nothing. Sending happens on a background thread, at most once every
`every_s` seconds plus on each new commit, on each change of GPU health and at the end; an apiserver that
refuses or cannot be reached is reported once as a warning and training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from datetime import datetime, timezone

from kiln.api import contract
from kiln.api.spec import GROUP, PLURAL, VERSION

log = logging.getLogger("kiln.status")

REPORT_EVERY_S = 10.0
REQUEST_TIMEOUT_S = 5.0
TRAINER_TIME = (("productive_s", "productiveSeconds"), ("checkpoint_stall_s", "checkpointStallSeconds"),
                ("rollback_s", "rollbackSeconds"), ("preflight_s", "preflightSeconds"))
DEGRADED = ("degraded_s", "degradedSeconds")  # replica groups only: productive steps with groups missing


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_patch(metrics: dict, checkpoint_info: dict | None, total_steps: int, *,
                 seconds_per_step: float | None = None, trainer_time: dict | None = None,
                 gpu_health: list[dict] | None = None, preflight: dict | None = None,
                 stragglers: list[dict] | None = None) -> dict:
    """The merge-patch body for the status subresource, from one step's metrics record (kiln.trainer.observe.metrics),
    the Checkpointer's `status()` and the run length. Only trainer-owned keys, camelCase as in the CRD."""
    step = int(metrics.get("rolled_back_to", metrics["step"]))
    status: dict = {"step": step, "progress": f"{100.0 * min(step, total_steps) / total_steps:.1f}%"}
    if gpu_health is not None:
        status["gpuHealth"] = gpu_health
    if preflight is not None:  # kiln.trainer.observe.preflight: this start's check
        status["preflight"] = preflight
    if stragglers is not None:  # kiln.trainer.observe.stragglers: a list, replaced whole by the merge patch
        status["stragglers"] = stragglers
    tracking = tracking_entry(metrics)
    if tracking is not None:
        status["tracking"] = tracking
    if seconds_per_step is not None and math.isfinite(seconds_per_step):
        status["etaSeconds"] = max(0, round((total_steps - step) * seconds_per_step))
    for key, field in (("tokens_per_second", "tokensPerSecond"), ("mfu", "mfu")):
        value = metrics.get(key)
        if value is not None and math.isfinite(value):
            status[field] = max(0.0, float(value))
    if metrics.get("ft_quorum_id") is not None:  # replica groups (kiln.trainer.membership.replica_groups): the last quorum
        status["quorum"] = {"id": int(metrics["ft_quorum_id"]), "liveGroups": int(metrics["ft_participants"]),
                            "groups": int(metrics["ft_groups"]), "changes": int(metrics["ft_quorum_changes"]),
                            "heals": int(metrics["ft_heals"])}
    last = (checkpoint_info or {}).get("lastCheckpoint")
    if last:
        ref = {"step": int(last["step"]), "uri": last["uri"]}
        if last.get("time") is not None:
            ref["time"] = rfc3339(last["time"])
        status["lastCheckpoint"] = ref
    if trainer_time is not None:
        status["trainerTime"] = {field: round(max(0.0, float(trainer_time[key])), 3) for key, field in
                                 (*TRAINER_TIME, DEGRADED) if key in trainer_time}
    return {"status": status}


def tracking_entry(record: dict) -> dict | None:
    """status.tracking from a record's tracker annotations (kiln.trainer.observe.tracking.Tracking.offer): the
    drops so far and the trackers' first failures; None while there are none."""
    dropped, error = int(record.get("tracking_dropped", 0)), record.get("tracking_error")
    if not dropped and not error:
        return None
    return {"dropped": dropped, **({"error": str(error)[:1024]} if error else {})}


class StatusReporter:
    """Rank 0's status writer. `update` after every step, `stalled` after a checkpoint blocked training,
    `close` at the end; `state_dict` goes into the checkpoint so the time counters (productive, checkpoint
    stall, rollback seconds) count from the run's start across restarts. The operator turns them into
    goodput (kiln.control.goodput)."""

    def __init__(self, total_steps: int, *, sender: StatusSender | None = None, restored: dict | None = None,
                 every_s: float = REPORT_EVERY_S, clock=time.monotonic):
        self.total_steps = total_steps
        self.every_s = every_s
        self._clock = clock
        self.load_state_dict((restored or {}).get("goodput"))
        self.resumed_at(int((restored or {}).get("step", 0)))
        self._seconds_per_step: float | None = None
        self._last_update: tuple[int, float] | None = None
        self._last_sent = -math.inf
        self._sent_commit: int | None = None
        self._record: dict | None = None
        self._gpu_health: list[dict] | None = None  # the newest gathered record["gpu_health"]
        self._sent_health: list[dict] | None = None
        self._preflight: dict | None = None  # status.preflight of this start's check
        self._stragglers: list[dict] | None = None  # the newest record["stragglers"]
        self._sent_stragglers: list | None = None
        self._sent_tracker_failed: tuple = (False, None)
        self._sender = sender  # None: account only, send nothing

    @classmethod
    def from_env(cls, total_steps: int, *, rank: int) -> StatusReporter:
        """Reports only on rank 0 and only when the pod's KILN_RUN_NAME and KILN_NAMESPACE are set."""
        run, namespace = os.environ.get(contract.RUN_NAME), os.environ.get(contract.NAMESPACE)
        sender = StatusSender(run, namespace) if rank == 0 and run and namespace else None
        return cls(total_steps, sender=sender)

    def state_dict(self) -> dict:
        return dict(self._time)

    def load_state_dict(self, state: dict | None) -> None:
        """The time counters a commit or a peer carried (None: a new run, or a commit saved before them)."""
        carried = state or {}
        self._time = {key: float(carried.get(key, 0.0)) for key, _ in TRAINER_TIME}
        if DEGRADED[0] in carried:
            self._time[DEGRADED[0]] = float(carried[DEGRADED[0]])

    def resumed_at(self, step: int) -> None:
        """The run goes on from `step`: a later step is progress, one at or before it is done again."""
        self._max_step = step

    def stalled(self, seconds: float) -> None:
        """Training was blocked this long by a checkpoint (staging, or a synchronous save)."""
        if math.isfinite(seconds) and seconds > 0:
            self._time["checkpoint_stall_s"] += seconds

    def preflight(self, result: dict, *, step: int) -> None:
        """The pre-flight check's result (kiln.trainer.observe.preflight): its seconds are `preflightSeconds`,
        the entry goes out with the first step's report."""
        from kiln.trainer.observe.preflight import status_entry

        self._time["preflight_s"] += max(0.0, float(result["seconds"]))
        self._preflight = status_entry(result, step=step, checked_at=rfc3339(time.time()))

    def update(self, record: dict, checkpoint_info: dict | None) -> None:
        """Account one finished step; hand a patch to the sender when it is due."""
        now, step = self._clock(), int(record["step"])
        # steps done again after a rollback were not progress; a rolled-back step was not either
        step_s = float(record.get("step_s", 0.0))
        if step > self._max_step and "rolled_back_to" not in record:
            self._time["productive_s"] += step_s
            self._max_step = step
            if "ft_groups" in record:  # replica groups: count the steps taken with groups missing
                self._time[DEGRADED[0]] = self._time.get(DEGRADED[0], 0.0) + \
                    (step_s if record["ft_participants"] < record["ft_groups"] else 0.0)
        else:
            self._time["rollback_s"] += step_s
        if self._last_update is not None and step > self._last_update[0]:
            per_step = (now - self._last_update[1]) / (step - self._last_update[0])
            self._seconds_per_step = per_step if self._seconds_per_step is None \
                else 0.8 * self._seconds_per_step + 0.2 * per_step
        elif self._seconds_per_step is None and record.get("step_s"):
            self._seconds_per_step = float(record["step_s"])
        self._last_update = (int(record.get("rolled_back_to", step)), now)
        self._record = record
        if record.get("gpu_health") is not None:
            self._gpu_health = record["gpu_health"]
        if record.get("stragglers") is not None:
            self._stragglers = record["stragglers"]
        commit = ((checkpoint_info or {}).get("lastCheckpoint") or {}).get("step")
        # a node's GPUs changing state goes out at once: the operator moves the run off a failing one
        if self._reports() and (now - self._last_sent >= self.every_s or commit != self._sent_commit
                                or _states(self._gpu_health) != _states(self._sent_health)
                                or _ranks(self._stragglers) != _ranks(self._sent_stragglers)
                                or _tracker_failed(record) != self._sent_tracker_failed):
            self._send(checkpoint_info)

    def close(self, checkpoint_info: dict | None = None) -> None:
        """The last report (with the final commit), then stop the sender within a short timeout."""
        if self._sender is None:
            return
        if self._record is not None and self._reports():
            self._send(checkpoint_info)
        self._sender.close()

    def hang(self, report: dict) -> None:
        """status.hang at once (kiln.trainer.observe.hang_report), from the hang watch's thread."""
        if self._sender is not None:
            self._sender.submit({"status": {"hang": report}})

    def _reports(self) -> bool:
        """Whether this rank writes the status: rank 0, and with replica groups only the group at replica rank 0
        of the last quorum (the one that writes commits): two writers of trainerTime a little apart would read
        to the operator as a trainer that went back (kiln.control.goodput)."""
        return self._sender is not None and int((self._record or {}).get("ft_replica_rank", 0)) == 0

    def _send(self, checkpoint_info: dict | None) -> None:
        self._sender.submit(status_patch(self._record, checkpoint_info, self.total_steps,
                                         seconds_per_step=self._seconds_per_step, trainer_time=self._time,
                                         gpu_health=self._gpu_health, preflight=self._preflight,
                                         stragglers=self._stragglers))
        self._last_sent = self._clock()
        self._sent_health = self._gpu_health
        self._sent_stragglers = self._stragglers
        self._sent_commit = ((checkpoint_info or {}).get("lastCheckpoint") or {}).get("step")
        self._sent_tracker_failed = _tracker_failed(self._record)


def _states(entries: list[dict] | None) -> list | None:
    """What a change of GPU health is judged by: each node's and GPU's state (not the step it was read at)."""
    return None if entries is None else [(e["node"], e["state"], [g["state"] for g in e.get("gpus") or []])
                                         for e in entries]


def _tracker_failed(record: dict | None) -> tuple:
    """What makes a tracker's trouble go out at once: its first drop and each new failure (not every drop)."""
    return bool((record or {}).get("tracking_dropped")), (record or {}).get("tracking_error")


def _ranks(entries: list[dict] | None) -> list | None:
    """What a change of stragglers is judged by: the ranks named and their nodes."""
    return None if entries is None else [(e["rank"], e["node"]) for e in entries]


class StatusSender:
    """One daemon thread that patches the newest body it was given (older unsent ones are dropped)."""

    def __init__(self, run: str, namespace: str):
        self.run, self.namespace = run, namespace
        self._cond = threading.Condition()
        self._pending: dict | None = None
        self._stopping = False
        self._api = None
        self._failing = False
        self._thread = threading.Thread(target=self._loop, name="kiln-status", daemon=True)
        self._thread.start()

    def submit(self, body: dict) -> None:
        with self._cond:
            self._pending = body
            self._cond.notify()

    def close(self, timeout: float = REQUEST_TIMEOUT_S + 2) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                body, self._pending = self._pending, None
            if body is None:
                return
            self._patch(body)

    def _patch(self, body: dict) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config import ConfigException

        try:
            if self._api is None:
                self._api = _custom_objects_api()
            self._api.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, PLURAL, self.run, body,
                                                            _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as err:
            self._failed(f"HTTP {err.status} {err.reason}: {_api_message(err)}")
        except ConfigException as err:
            self._failed(f"no Kubernetes credentials ({err}); set KUBECONFIG or run in a pod")
        except Exception as err:  # noqa: BLE001 - connection refused, DNS, TLS, timeouts: never fatal to training
            self._failed(str(getattr(err, "reason", None) or f"{type(err).__name__}: {err}"))  # urllib3: the cause
        else:
            if self._failing:
                log.warning("status: writing TrainingSpec %s/%s status works again", self.namespace, self.run)
            self._failing = False

    def _failed(self, cause: str) -> None:
        if not self._failing:
            host = self._api.api_client.configuration.host if self._api is not None else \
                os.environ.get("KUBECONFIG") or "in-cluster/~/.kube/config"
            log.warning("status: cannot patch the status of TrainingSpec %s/%s at %s (%s); training goes on, "
                        "the next reports are retried quietly", self.namespace, self.run, host, cause)
        else:
            log.debug("status: patch failed again: %s", cause)
        self._failing = True


def _custom_objects_api():
    """In a pod: the ServiceAccount's in-cluster credentials, unless KUBECONFIG is set; else the kubeconfig."""
    from kubernetes import client, config

    configuration = client.Configuration()
    kubeconfig = os.environ.get("KUBECONFIG")  # read now: the client's own default is fixed at its import
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.retries = 0  # the next report is the retry; the sender must not hang on a dead apiserver
    return client.CustomObjectsApi(client.ApiClient(configuration))


def _api_message(err) -> str:
    try:
        return json.loads(err.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return str(err.body or "")[:200]
