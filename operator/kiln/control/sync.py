"""What one reconcile does: read what exists → plan (pure) → apply → status (pure) → patch and Events.

The kopf handlers call these two functions and nothing else. Each run is handled under its own lock,
because pod, job and spec events for one run can arrive at once on different worker threads.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

from pydantic import ValidationError

from kiln.api.load import format_validation_error
from kiln.api.spec import TrainingSpec
from kiln.control.config import OperatorConfig
from kiln.control.elastic_sync import carried_avoid, carried_nodes
from kiln.control.kube import Kube
from kiln.control.plan import Observed, plan
from kiln.control.status import Event, changed, derive, job_condition
from kiln.errors import KilnError

PostEvent = Callable[[dict, Event], None]

_locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)


class Wait(Exception):
    """The reconcile must be retried later (kopf.TemporaryError in the handler)."""


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(kube: Kube, body: dict, config: OperatorConfig, post: PostEvent) -> str:
    """Make the cluster match one TrainingSpec; returns a one-line summary for the log."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    with _locks[(namespace, name)]:
        job = kube.job(namespace, name)
        state = job_condition(job)
        observed = Observed(applied=kube.applied_spec(namespace, name),
                            job_active=job is not None and state not in ("Succeeded", "Failed"))
        accepted: tuple[str, str, str]
        try:
            doc = TrainingSpec.model_validate(body)
            # keep the node count the elastic loop chose (kiln.control.elastic_sync) across spec edits
            desired = plan(doc, replace(observed, nodes=carried_nodes(body, doc), avoid_nodes=carried_avoid(body)),
                           config)
        except ValidationError as err:  # only when the CRD in the cluster lacks kiln's schema rules
            accepted, desired = ("False", "InvalidSpec", format_validation_error(err)), None
        except KilnError as err:
            accepted, desired = ("False", "InvalidSpec", str(err)), None
        if desired is not None:
            problem = None
            secret = doc.spec.checkpoint.credentials_secret
            if desired.refused:
                accepted = ("False", "ImmutableFieldChanged", desired.refused)
            elif secret and (problem := kube.secret_problem(namespace, secret)):
                accepted = ("False", "SecretMissing", problem + "; create it, the run starts by itself then")
            else:
                # Suspend needs no step of its own here: the training-operator deletes the pods, each trainer
                # gets SIGTERM, all ranks agree on a step and commit it within the grace period (plan.py).
                for obj in desired.objects:  # the job last: its pods mount the ConfigMap
                    kube.apply(obj)
                accepted = ("True", "Applied", "the PyTorchJob and ConfigMap match the spec")
        _write_status(kube, body, post, accepted)
        if accepted[0] == "False" and accepted[1] == "SecretMissing":
            raise Wait(accepted[2])  # retry: the Secret may be created any moment
        return f"{namespace}/{name}: {accepted[1]}"


def refresh_status(kube: Kube, namespace: str, name: str, post: PostEvent) -> None:
    """Recompute the status after the job or one of its pods changed."""
    with _locks[(namespace, name)]:
        body = kube.trainingspec(namespace, name)
        if body is not None:
            _write_status(kube, body, post, None)


def _write_status(kube: Kube, body: dict, post: PostEvent, accepted) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    job = kube.job(namespace, name)
    pods = kube.pods(namespace, name) if job is not None else []
    result = derive(body, job, pods, now(), accepted)
    if changed(body.get("status") or {}, result.status):
        kube.patch_status(namespace, name, result.status)
    for event in result.events:
        post(body, event)
