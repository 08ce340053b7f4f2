"""What one reconcile does: read what exists → plan (pure) → apply → status (pure) → patch and Events.

The kopf handlers call these functions and nothing else. Each run is handled under its own lock
(kiln.control.runs), because pod, job and spec events and the periodic tick of one run can arrive at once
on different worker threads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kiln.api.load import format_validation_error
from kiln.api.spec import TrainingSpec
from kiln.control import kueue
from kiln.control.config import OperatorConfig, Pricing
from kiln.control.elastic_state import carried_avoid, carried_nodes
from kiln.control.kube import Kube, now
from kiln.control.parts import Layout, layout_of_stored
from kiln.control.plan import Observed, plan
from kiln.control.job_state import job_condition
from kiln.control.status import Event, changed, derive, pods_to_stop, same_condition, set_condition
from kiln.errors import KilnError

PostEvent = Callable[[dict, Event], None]
READ = object()  # refresh_status: read the job / list the pods (no cached copy at hand)


class Wait(Exception):
    """The reconcile must be retried later (kopf.TemporaryError in the handler, with a growing delay)."""


def backoff_s(retry: int, base_s: float = 5.0, cap_s: float = 300.0) -> float:
    """Delay before retry number `retry` (0 for the first) of a failed reconcile: 5 s doubling up to 5 min.
    A Secret created a second later starts the run soon; an apiserver down for an hour is not hammered."""
    return min(cap_s, base_s * 2 ** min(max(retry, 0), 16))


def reconcile(kube: Kube, body: dict, config: OperatorConfig, post: PostEvent, pods=READ, resync: bool = False) -> str:
    """Make the cluster match one TrainingSpec; returns a one-line summary for the log.

    API calls: read the PyTorchJob; the ConfigMap only when that job runs (the spec it runs with decides
    what may change); the credentials Secret when the spec names one; while the run has no PyTorchJob of its
    own, each other object once before this operator first applies it (someone else's is never taken over:
    see `foreign`); then one server-side apply per object this operator has not applied with the same
    content before, and at most one status patch. A new run costs 5 reads + 5 applies + 1 status patch;
    suspending a running one, 2 reads (job, ConfigMap) + 2 applies (ConfigMap, job) + 1 status patch.
    pods: the run's pods as the operator's watch has them (kopf index; a function returning them is called under
    the run's lock, observed_now), or READ to list them.
    resync: send every object again even if unchanged since this process applied it (the periodic resync:
    server-side apply puts back what someone else deleted or changed in the fields kiln sets).
    A read or apply the apiserver fails ends in SpecAccepted=False naming it, and raises Wait (retried).
    """
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    run = kube.runs[(namespace, name)]
    with run.lock:
        pods = observed_now(pods)
        run.reconciled_at = time.monotonic()
        try:
            layout = layout_of_stored(body)
            wanted = layout.job_names(name)
            jobs = {n: kube.job(namespace, name, n) for n in layout.read_names(name)}
            job, group_jobs = layout.view(name, [j for j in jobs.values() if j])
            if any(jobs[n] is None for n in wanted) or resync:  # never made, or deleted by someone: the other
                kube.forget_applied(namespace, name)                # objects may be gone too
            job_active = any(j is not None and job_condition(j) not in ("Succeeded", "Failed") for j in jobs.values())
            coverage, left_out = kueue.observe_queue(
                kube, namespace, ((body.get("spec") or {}).get("scheduling") or {}).get("queue"),
                list(jobs.values()), config.kueue_excluded_resource_prefixes)
            observed = Observed(applied=kube.applied_spec(namespace, name) if job_active else None,
                                job_active=job_active, queue_coverage=coverage, left_out=left_out)
        except ApiException as err:  # nothing is known, so nothing is derived: say why, retry
            _report(kube, body, post, ("False", "ReadFailed", read_failure(namespace, name, err)))
            raise Wait(f"{namespace}/{name}: reading the run's objects failed ({err.status})") from None
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
                accepted = ("False", desired.refused_reason, desired.refused)
            elif secret and (problem := _secret_problem(kube, namespace, secret)):
                accepted = problem
            else:
                # Suspend needs no step of its own here: the training-operator deletes the pods, each trainer
                # gets SIGTERM, all ranks agree on a step and commit it within the grace period (plan.py).
                accepted = ("True", "Applied", "; ".join(["the PyTorchJob and ConfigMap match the spec", *desired.notes]))
                done = apply_plan(kube, desired.objects, jobs, wanted, body["metadata"].get("uid"))
                accepted, jobs = done.refusal or accepted, done.jobs
                if done.created:
                    pods = []  # created just now: the training-operator has made no pod yet
                job, group_jobs = layout.view(name, [j for j in jobs.values() if j])
        _write_status(kube, body, post, accepted, job, pods, group_jobs, pricing=config.pricing, layout=layout)
        if accepted[0] == "False" and accepted[1] in RETRIED:
            raise Wait(accepted[2])  # retried with a delay: the cause may go away without a spec change
        return f"{namespace}/{name}: {accepted[1]}"


# SpecAccepted reasons whose cause may pass without a spec change (a Secret created, a foreign object
# removed, the apiserver back): the reconcile is retried. An apply the apiserver refuses as invalid
# (ApplyRefused) is not, nor is an invalid spec: only a new spec can help, and it brings a new reconcile.
# NotCoveredByQueue: the admin may add the resource to the ClusterQueue, which the operator does not watch.
RETRIED = ("SecretMissing", "NotOwner", "ApplyFailed", "ReadFailed", "NotCoveredByQueue")


def _secret_problem(kube: Kube, namespace: str, secret: str) -> tuple[str, str, str] | None:
    """SpecAccepted=False when the credentials Secret is missing or lacks a key, as far as the operator may
    see. The shipped RBAC grants no Secret access (the check is skipped; the kubelet reports it on the pod,
    ContainerConfigError); an admin may grant `get` on named Secrets to have it checked before any pod."""
    try:
        problem = kube.secret_problem(namespace, secret)
    except ApiException as err:
        return "False", "ReadFailed", read_failure(namespace, secret, err, kind="Secret")
    return ("False", "SecretMissing", problem + "; create it, the run starts by itself then") if problem else None


def read_failure(namespace: str, name: str, err: ApiException, kind: str = "run's objects") -> str:
    what = f"Secret {namespace}/{name}" if kind == "Secret" else f"the objects of {namespace}/{name}"
    return f"reading {what} failed ({err.status}): {_message(err)}"[:2000]


def _report(kube: Kube, body: dict, post: PostEvent, accepted: tuple[str, str, str]) -> None:
    """Only SpecAccepted (and its Warning Event): what the run's objects look like could not be read."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    old = (kube.last_spec(namespace, name) or body).get("status") or {}
    if not same_condition(old, "SpecAccepted", *accepted):
        post(body, Event("Warning", accepted[1], accepted[2]))
        kube.patch_status(namespace, name, {"conditions": set_condition(
            list(old.get("conditions") or []), "SpecAccepted", *accepted, now(),
            (body.get("metadata") or {}).get("generation"))})


def foreign(existing: dict | None, owner_uid: str | None) -> str | None:
    """Why the operator must not apply over `existing` (None: there is no such object, or it belongs to the
    run with this uid). Server-side apply with force would take it over, and the garbage collector would
    delete it with the run; a ServiceAccount of someone else's may carry stronger RoleBindings."""
    if existing is None:
        return None
    meta = existing.get("metadata") or {}
    owners = meta.get("ownerReferences") or []
    if owner_uid and any(o.get("uid") == owner_uid for o in owners):
        return None
    held = ", ".join(f"{o.get('kind')} {o.get('name')}" for o in owners) or "no owner"
    return (f"{existing.get('kind')} {meta.get('namespace')}/{meta.get('name')} exists and is not this run's "
            f"({held}); kiln does not take over objects it did not create: delete or rename that object, or "
            f"rename this TrainingSpec")


@dataclass(frozen=True)
class Applied:
    refusal: tuple[str, str, str] | None  # ("False", reason, message): why the objects from there on were not applied
    jobs: dict[str, dict | None]  # the run's PyTorchJobs by name, as the applies returned them
    created: bool = False  # a PyTorchJob was made for a run that had none


def apply_plan(kube: Kube, objects: list[dict], jobs: dict[str, dict | None], wanted: list[str],
               uid: str | None) -> Applied:
    """Apply a plan's objects in order (the job last: its pods mount the ConfigMap): the one place that applies
    a run's desired objects, for the reconcile and the elastic tick alike.

    jobs: the run's PyTorchJobs by name as at hand (None: not there); wanted: the names the run's layout has.
    Server-side apply with force would take over an object someone else owns, so each object is checked first
    (`foreign`; a read unless this process applied it before), except when every job of the run exists and is
    this run's: the job is applied last, each object before it checked, so a job of this run's vouches for them.
    Stops at the first object not applied: NotOwner, or ApplyRefused/ApplyFailed with the apiserver's reason."""
    jobs, had_job = dict(jobs), any(jobs.values())
    checked = all(jobs.get(n) is not None and foreign(jobs[n], uid) is None for n in wanted)
    for obj in objects:
        is_job = obj["kind"] == "PyTorchJob"
        try:
            # the run's Secret is only ever created (Kube.apply): it takes nothing over, and it cannot be read
            if not checked and obj["kind"] != "Secret" and not kube.applied_before(obj):
                other = foreign(jobs.get(obj["metadata"]["name"]) if is_job else kube.read(obj), uid)
                if other:
                    return Applied(("False", "NotOwner", other), jobs)
            applied = kube.apply(kueue.with_admitted_tolerations(obj, jobs.get(obj["metadata"]["name"]))
                                 if is_job else obj)
        except ApiException as err:  # refused as invalid, or the apiserver failed: say which
            return Applied(("False", "ApplyRefused" if refused(err) else "ApplyFailed", apply_failure(obj, err)), jobs)
        if is_job and applied is not None:
            jobs[obj["metadata"]["name"]] = applied
    return Applied(None, jobs, created=not had_job and any(jobs.values()))


def refused(err: ApiException) -> bool:
    """Whether the apiserver refused an apply as invalid (trying again cannot help). A body that does not fit
    the object's schema (a malformed affinity) fails server-side apply's typed conversion, which the
    apiserver answers with 500 and this message rather than 422."""
    typed_patch = err.status == 500 and "failed to create typed patch object" in _body(err)
    return err.status in (400, 422) or typed_patch


def _body(err: ApiException) -> str:
    body = err.body or ""  # bytes when the request did not preload its content (Kube.apply)
    return body.decode(errors="replace") if isinstance(body, bytes) else str(body)


def _message(err: ApiException) -> str:
    try:
        return json.loads(_body(err) or "{}").get("message") or err.reason
    except (ValueError, AttributeError):
        return err.reason


def apply_failure(obj: dict, err: ApiException) -> str:
    """The apiserver's reason for refusing an apply, naming the object, in one bounded line."""
    meta = obj["metadata"]
    return f"applying {obj['kind']} {meta['namespace']}/{meta['name']} failed ({err.status}): {_message(err)}"[:2000]


def observed_now(seen):
    """A watch's view given as a function (`lambda: indexes.pods(...)`) read now, under the run's lock: read
    before it, by a handler that then waited for the lock, it may be older than the view another handler has
    written the status from meanwhile, and deriving from it would move the status back (a group Running, then
    "Restarting" from a stale pod list, counted as a restart; seen on a loaded CI machine)."""
    return seen() if callable(seen) else seen


def refresh_status(kube: Kube, namespace: str, name: str, post: PostEvent, job=READ, pods=READ,
                   pricing: Pricing = Pricing()) -> None:
    """Recompute the status after the job or one of its pods changed.

    job: the run's PyTorchJobs as the operator's watch has them (a list: with replica groups, one per group),
    the run's one job (a dict), None (no job) or READ to ask the apiserver. pods: as the watch has them, or READ.
    Either may be a function that returns it, called under the run's lock (observed_now).
    The TrainingSpec is the one this operator last read or wrote the status of (read once after a start).
    That copy holds the newest value of every field derive() computes, since no one else writes those, and
    all of them go through Kube.patch_status; a watch's copy may be older (deriving from an older status
    posts a phase change twice or drops a condition written meanwhile). What it may lack is newer than the
    status needs: the trainer's progress (goodput credits its counters on the next refresh) and a spec edit
    (whose reconcile follows, under the same lock, with the new spec).
    """
    with kube.runs[(namespace, name)].lock:
        job, pods = observed_now(job), observed_now(pods)
        body = kube.last_spec(namespace, name) or kube.trainingspec(namespace, name)
        if body is not None:
            layout = layout_of_stored(body)
            if job is READ:
                job = [j for n in layout.job_names(name) if (j := kube.job(namespace, name, n)) is not None]
            job, group_jobs = layout.view(name, job if isinstance(job, list) else [job] if job else [])
            _write_status(kube, body, post, None, job, pods, group_jobs, pricing=pricing, layout=layout)


def job_unseen(kube: Kube, namespace: str, name: str, job: dict) -> bool:
    """Whether the status may not reflect this version of the run's job yet (False for the watch's echo
    of what this operator applied or already refreshed from)."""
    run = kube.runs.get((namespace, name))
    return run is None or run.derived_from != (job.get("metadata") or {}).get("resourceVersion")


def _write_status(kube: Kube, body: dict, post: PostEvent, accepted, job: dict | None, pods=READ,
                  group_jobs: list[dict | None] | None = None, pricing: Pricing = Pricing(),
                  layout: Layout | None = None) -> None:
    """Derive and patch the status from the job (as just read or applied; with replica groups the combined
    one, kiln.control.replica_groups.combined_job, and each group's) and its pods."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    known = kube.last_spec(namespace, name)
    if known is not None and known is not body and known["metadata"].get("uid") == body["metadata"].get("uid"):
        # a kopf event's copy may predate this operator's last status write: derive from that write
        body = {**body, "status": known.get("status") or {}}
    if pods is READ:
        pods = kube.pods(namespace, name) if job is not None else []
    # a queued run: why it waits (a Workload read; with replica groups, one per group due a read)
    part = (layout or layout_of_stored(body)).status_inputs(kube, job, group_jobs, body.get("status"))
    result = derive(body, job, pods, now(), accepted, pricing=pricing, **part)
    if changed(body.get("status") or {}, result.status):
        kube.patch_status(namespace, name, result.status)
    else:
        kube.runs[(namespace, name)].spec = body
    for event in result.events:
        post(body, event)
    stop = pods_to_stop(job, pods)
    for pod in stop:
        kube.delete_pod(namespace, pod)  # gone already is what was wanted
    if stop:
        post(body, Event("Warning", "PodsStopped", f"the run failed; stopped its pods still running: {', '.join(stop)}"))
    kube.runs[(namespace, name)].derived_from = ((job or {}).get("metadata") or {}).get("resourceVersion")
