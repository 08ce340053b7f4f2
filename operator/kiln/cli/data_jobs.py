"""`kiln data prepare --workers N` on the cluster: each stage of kiln.trainer.data.stages as an Indexed Job that the
CLI creates with the user's own permissions (no operator), followed by the stages' markers in the store.

`render_job` is pure (a batch/v1 Job as a dict); `run` submits the stages in order, skipping finished ones, and
follows each to its end; `status` reports and, for a `--detach`ed preparation, submits the next stage once the one
before has finished (nothing runs between two `kiln data status` calls but the submitted Job)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

from kiln.errors import KilnError
from kiln.trainer.data import stages

PREPARE_LABEL = "kiln.dev/data-prepare"  # the preparation (a hash of its output URI) a Job belongs to
STAGE_LABEL = "kiln.dev/data-stage"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln"}
JOBS = stages.WORK + "jobs.json"  # how this preparation's Jobs are made: `kiln data status` submits the next
BACKOFF_PER_INDEX = 3  # a failed or deleted pod of an index is retried this often before the index fails
POLL_S = 2.0  # how often the CLI reads the stage's markers (the Job's progress lives in the store)


@dataclass(frozen=True)
class JobSettings:
    """Where and how the stage pods run: what a TrainingSpec in `namespace` would use."""

    namespace: str
    image: str
    output: str
    endpoint: str | None = None
    credentials_secret: str | None = None  # a Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    pull_policy: str = "IfNotPresent"
    cpu: str = "1"
    memory: str = "2Gi"
    node_selector: dict[str, str] = field(default_factory=dict)  # the TrainingSpec's node pool, as its pods'
    tolerations: list[dict] = field(default_factory=list)  # core/v1 Tolerations, camelCase


def prepare_id(output: str) -> str:
    return hashlib.sha256(output.encode()).hexdigest()[:10]


def job_name(output: str, stage: str) -> str:
    return f"kiln-data-{prepare_id(output)}-{stage}"


def render_job(js: JobSettings, stage: str, completions: int, workers: int) -> dict:
    """The Indexed Job of `stage`: `completions` indexes, at most `workers` pods at a time, each index retried
    BACKOFF_PER_INDEX times on its own; the pod runs as the trainer's does under Pod Security `restricted`."""
    labels = {PREPARE_LABEL: prepare_id(js.output), STAGE_LABEL: stage, **MANAGED_BY}
    env = [{"name": "TMPDIR", "value": "/tmp"}, {"name": "HOME", "value": "/tmp"}]
    if js.credentials_secret:  # by reference: the keys never appear in the Job
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": js.credentials_secret, "key": key}}}
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    args = [stage, js.output] + (["--endpoint", js.endpoint] if js.endpoint else [])
    container = {
        "name": "stage", "image": js.image, "imagePullPolicy": js.pull_policy,
        "command": ["python", "-m", "kiln.trainer.data.stages"], "args": args, "env": env,
        "resources": {"requests": {"cpu": js.cpu, "memory": js.memory}, "limits": {"memory": js.memory}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job_name(js.output, stage), "namespace": js.namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed", "completions": completions, "parallelism": min(workers, completions),
            # a failed or deleted pod (eviction, `kubectl delete pod`) is retried for its index alone
            "backoffLimitPerIndex": BACKOFF_PER_INDEX,
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never", "containers": [container],
                         **({"nodeSelector": js.node_selector} if js.node_selector else {}),
                         **({"tolerations": js.tolerations} if js.tolerations else {}),
                         "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                         "volumes": [{"name": "tmp", "emptyDir": {}}]},
            },
        },
    }


def stage_progress(out, plan: dict) -> list[dict]:
    """Per stage: its indexes, how many have finished, and their summed documents, bytes and tokens."""
    rows = []
    for stage in stages.STAGES:
        n = stages.count(plan, stage)
        if not n:
            continue
        done = stages.finished(out, stage)
        rows.append({"stage": stage, "indexes": n, "done": len(done),
                     **{k: sum(d.get(k, 0) for d in done) for k in ("documents", "bytes", "tokens")}})
    return rows


def next_stage(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["done"] < r["indexes"]), None)


def _create(batch, job: dict) -> None:
    from kubernetes.client.rest import ApiException

    try:
        batch.create_namespaced_job(job["metadata"]["namespace"], job)
    except ApiException as err:
        if err.status != 409:  # 409: a rerun finds its stage's Job there, and follows it
            from kiln.client import api_message

            raise KilnError(f"creating Job {job['metadata']['namespace']}/{job['metadata']['name']}: "
                            f"{api_message(err)}") from None


def _failed(batch, js: JobSettings, stage: str) -> str | None:
    from kubernetes.client.rest import ApiException

    try:
        job = batch.read_namespaced_job(job_name(js.output, stage), js.namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    for c in job.status.conditions or []:
        if c.type == "Failed" and c.status == "True":
            return (f"stage {stage} failed ({c.reason}: {c.message}); failed indexes {job.status.failed_indexes}: "
                    f"kubectl logs -n {js.namespace} -l {STAGE_LABEL}={stage},{PREPARE_LABEL}={prepare_id(js.output)}")
    return None


def submit_next(batch, out, plan: dict, js: JobSettings) -> dict | None:
    """Submit the first unfinished stage (or find its Job there); None when every stage is done."""
    row = next_stage(stage_progress(out, plan))
    if row is not None:
        _create(batch, render_job(js, row["stage"], row["indexes"], plan["workers"]))
    return row


def save_settings(out, js: JobSettings) -> None:
    out.put_bytes(JOBS, json.dumps(asdict(js)).encode())


def load_settings(out) -> JobSettings:
    return JobSettings(**json.loads(out.get_bytes(JOBS)))


def run(batch, out, plan: dict, js: JobSettings, *, detach: bool, keep: bool, on_progress=None) -> bool:
    """Submit and follow every unfinished stage; True once the manifest is written. With detach, submit the
    first and return False. A failed stage is one KilnError line naming it and how to read its logs."""
    save_settings(out, js)
    while (row := submit_next(batch, out, plan, js)) is not None:
        if detach:
            return False
        while True:  # the stage's own markers, written by its pods, are its progress
            rows = stage_progress(out, plan)
            if on_progress is not None:
                on_progress(rows)
            if next(r for r in rows if r["stage"] == row["stage"])["done"] == row["indexes"]:
                break
            if (why := _failed(batch, js, row["stage"])) is not None:
                raise KilnError(why)
            time.sleep(POLL_S)
    if not keep:
        cleanup(batch, out, js)
    return True


def cleanup(batch, out, js: JobSettings) -> None:
    """Delete this preparation's finished Jobs (their pods with them) and the stages' work/ folder."""
    selector = f"{PREPARE_LABEL}={prepare_id(js.output)}"
    for job in batch.list_namespaced_job(js.namespace, label_selector=selector).items:
        batch.delete_namespaced_job(job.metadata.name, js.namespace, propagation_policy="Background")
    out.delete_prefix(stages.WORK)


def settings_from(args) -> JobSettings:
    """The namespace, image and S3 settings a TrainingSpec would use: --spec FILE's (metadata.namespace,
    spec.image, checkpoint.endpoint and checkpoint.credentialsSecret, each overridden by its flag; and
    resources.nodeSelector and tolerations, so the stage pods land in the run's node pool); else the kubeconfig's
    namespace and the operator's default trainer image."""
    from kiln.client import default_namespace
    from kiln.control.config import DEFAULT_IMAGE

    namespace = image = endpoint = secret = None
    pool: dict = {}
    if args.spec:
        from kiln.api.load import load_one

        doc = load_one(args.spec)
        namespace, image = doc.metadata.namespace, doc.spec.image
        endpoint, secret = doc.spec.checkpoint.endpoint, doc.spec.checkpoint.credentials_secret
        r = doc.spec.resources
        pool = {"node_selector": dict(r.node_selector),
                "tolerations": [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in r.tolerations]}
    for uri, what in [(args.output, "--output"), (args.tokenizer, "--tokenizer"),
                      *((u, "--input") for u in args.input)]:
        if not uri.startswith("s3://"):
            raise KilnError(f"{what} {uri}: with --workers every pod reads and writes the store: use s3://bucket/prefix/")
    return JobSettings(namespace=args.namespace or namespace or default_namespace(args.kubeconfig),
                       image=args.image or image or DEFAULT_IMAGE, output=args.output,
                       endpoint=args.endpoint or endpoint, credentials_secret=args.credentials_secret or secret,
                       **pool)


def _batch(args):
    from kubernetes import client

    from kiln.control.kube import api_client

    return client.BatchV1Api(api_client(args.kubeconfig, args.context))


@contextlib.contextmanager
def progress_bar(console):
    """One bar per stage (indexes finished of all, documents, bytes, tokens), redrawn from the markers."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TextColumn("indexes"),
                  TextColumn("{task.fields[documents]:,} docs {task.fields[bytes]:,} B {task.fields[tokens]:,} tokens"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(rows: list[dict]) -> None:
            for r in rows:
                if r["stage"] not in tasks:
                    tasks[r["stage"]] = bar.add_task(r["stage"], total=r["indexes"], documents=0, bytes=0, tokens=0)
                bar.update(tasks[r["stage"]], completed=r["done"], documents=r["documents"], bytes=r["bytes"],
                           tokens=r["tokens"], refresh=True)
        yield update


def cmd_prepare_workers(args) -> int:
    from rich.console import Console

    from kiln.cli.data_cmds import quality_settings
    from kiln.storage import open_store

    js = settings_from(args)
    out = open_store(args.output, endpoint=js.endpoint)
    if out.exists("manifest.json"):
        print(f"kiln: {out.url('manifest.json')} exists: {args.output} is already prepared; nothing to do")
        return 0
    plan = stages.plan(args.input, args.output, tokenizer_uri=args.tokenizer, workers=args.workers,
                       partitions=args.partitions, text_field=args.text_field, min_chars=args.min_chars,
                       dedup=args.dedup, minhash_threshold=args.minhash_threshold, eos=args.eos,
                       shard_tokens=args.shard_tokens, quality=quality_settings(args), endpoint=js.endpoint,
                       **({} if args.max_doc_bytes is None else {"max_doc_bytes": args.max_doc_bytes}))
    with progress_bar(Console(stderr=True)) as update:
        done = run(_batch(args), out, plan, js, detach=args.detach, keep=args.keep, on_progress=update)
    if not done:
        print(f"kiln: submitted to namespace {js.namespace}; follow it with: kiln data status --output {args.output}")
        return 0
    return report(out, args.output)


def report(out, output: str) -> int:
    manifest = json.loads(out.get_bytes("manifest.json"))
    removed = ", ".join(f"{k} {v}" for k, v in manifest["removed"].items()) or "nothing"
    print(f"kiln: {manifest['documents_out']:,} of {manifest['documents_in']:,} documents, {manifest['tokens']:,} "
          f"tokens in {len(manifest['shards'])} shard(s) at {output}; removed: {removed}", flush=True)
    return 0


def cmd_status(args) -> int:
    """Each stage's finished indexes and counts; submits the next stage of a --detach'ed preparation."""
    from kiln.storage import open_store
    from kiln.storage.store import ObjectNotFound

    out = open_store(args.output, endpoint=args.endpoint)
    if out.exists("manifest.json"):
        return report(out, args.output)
    try:
        plan = json.loads(out.get_bytes(stages.PLAN))
        js = load_settings(out)
    except ObjectNotFound:
        raise KilnError(f"--output {args.output}: no preparation there (`kiln data prepare --workers N` starts one)") from None
    batch = _batch(args)
    for r in stage_progress(out, plan):
        print(f"{r['stage']:>9}: {r['done']}/{r['indexes']} indexes, {r['documents']:,} documents, "
              f"{r['bytes']:,} bytes, {r['tokens']:,} tokens")
    row = next_stage(stage_progress(out, plan))
    if (why := _failed(batch, js, row["stage"])) is not None:
        raise KilnError(why)
    submit_next(batch, out, plan, js)
    if out.exists("manifest.json"):
        return report(out, args.output)
    print(f"kiln: running stage {row['stage']} ({job_name(js.output, row['stage'])} in {js.namespace})")
    return 0
