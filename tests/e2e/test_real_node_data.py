"""`kiln data prepare --workers N` for real: each stage an Indexed Job whose pods run the trainer image on the rig's
real node (placed there by the --spec TrainingSpec's nodeSelector and tolerations), reading and writing the rig's
S3. A corpus with exact and near duplicates planted across input files gives byte-identical shards and manifest
with 1 and 3 workers, equal to the one-process command's (the oracle: a set of hashes and datasketch's MinHashLSH);
and in the 3-worker run pods are deleted (the first of each stage, and one of buckets once that stage is part
done): the Job runs each such index again in a new pod and the output is still identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import yaml

from kiln.cli import data_jobs
from kiln.storage import open_store
from kiln.trainer.data import prepare as one
from kiln.trainer.data import stages
from tests.support.data_stages import outputs, planted_corpus, settings, tokenizer_file  # noqa: F401 - fixture
from tests.support.real_node import cpu_run, kiln, loaded_images, runs_ns  # noqa: F401 - fixtures
from tests.support.s3 import s3_prefix  # noqa: F401 - fixture

pytestmark = [pytest.mark.rig, pytest.mark.slow]

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
TIMEOUT = 900  # a safety net for a loaded 2-core machine; progress, not the clock, drives every step


def _prepare_args(src: str, tok: str, out: str, workers: int, spec, endpoint: str) -> list[str]:
    return ["data", "prepare", "--input", src, "--tokenizer", tok, "--output", out, "--dedup", "minhash",
            "--eos", "<eos>", "--shard-tokens", "50", "--min-chars", "2", "--partitions", "3",
            "--workers", str(workers), "--spec", str(spec), "--endpoint", endpoint, "--keep"]


def _stage_pods(rig, ns: str, out: str, stage: str) -> list[dict]:
    selector = f"{data_jobs.PREPARE_LABEL}={data_jobs.prepare_id(out)},{data_jobs.STAGE_LABEL}={stage}"
    return json.loads(rig.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout)["items"]


def _prepare_deleting_pods(rig, ns, args: list[str], out: str, endpoint: str) -> list[tuple]:
    """Run the command while watching its pods: delete the first pod of each stage as its Job creates it, and in
    buckets (9 indexes, 3 at a time: later pods come only as earlier indexes finish) also the first pod created
    after a marker shows the stage part done. A pod deleted as it is created cannot have finished (on this tiny
    corpus a pod that runs finishes in about a second, before a delete of it would land), so its Job must run
    the index again. Returns the deleted pods as (stage, index, name)."""
    from kubernetes import client, watch

    from kiln.control.kube import api_client

    core = client.CoreV1Api(api_client(str(rig.kubeconfig)))
    store = open_store(out, endpoint=endpoint)
    deleted: list[tuple] = []
    stop = watch.Watch()

    def follow() -> None:
        hit = set()
        for event in stop.stream(core.list_namespaced_pod, ns, timeout_seconds=TIMEOUT,
                                 label_selector=f"{data_jobs.PREPARE_LABEL}={data_jobs.prepare_id(out)}"):
            pod = event["object"]
            stage, index = pod.metadata.labels[data_jobs.STAGE_LABEL], int(pod.metadata.labels[INDEX_LABEL])
            if event["type"] != "ADDED" or pod.metadata.deletion_timestamp is not None:
                continue
            mid = stage == "buckets" and stage in hit and "buckets-mid" not in hit and store.list(
                f"{stages.WORK}done/buckets/")
            if stage not in hit or mid:
                core.delete_namespaced_pod(pod.metadata.name, ns)
                deleted.append((stage, index, pod.metadata.name))
                hit.add("buckets-mid" if mid else stage)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    env = {**rig.env, "AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=TIMEOUT)
    stop.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return list(deleted)


def test_one_and_three_workers_on_the_real_node_give_one_result_and_a_deleted_pod_is_retried(
        rig, real_node, loaded_images, runs_ns, s3_prefix, tokenizer_file, tmp_path):  # noqa: F811
    planted = planted_corpus(tmp_path / "src")
    endpoint = real_node.s3_endpoint  # the pods' way to the rig's S3 (this machine reaches it too)
    store = open_store(s3_prefix, endpoint=endpoint)
    for f in sorted((tmp_path / "src").iterdir()):
        store.put_file(f"src/{f.name}", f)
    store.put_file("tok/tokenizer.json", tokenizer_file)
    spec = cpu_run(rig, real_node, runs_ns, "data-prep", steps=1, interval=1)  # its namespace, pool, S3 secret
    spec["spec"]["image"] = loaded_images["trainer"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    src, tok = s3_prefix + "src/", s3_prefix + "tok/tokenizer.json"

    kiln(*_prepare_args(src, tok, s3_prefix + "w1/", 1, tmp_path / "spec.yaml", endpoint), rig=rig, timeout=TIMEOUT)
    out3 = s3_prefix + "w3/"
    deleted = _prepare_deleting_pods(
        rig, runs_ns, _prepare_args(src, tok, out3, 3, tmp_path / "spec.yaml", endpoint), out3, endpoint)

    # each deleted pod's index was run again by its Job (kept: --keep), in a pod of its own that succeeded; the
    # command ends on the manifest's marker, which the last pod writes before its Job sees it succeed
    selector = f"{data_jobs.PREPARE_LABEL}={data_jobs.prepare_id(out3)}"
    rig.kubectl("wait", "-n", runs_ns, "--for=condition=Complete", "job", "-l", selector, f"--timeout={TIMEOUT}s",
                timeout=TIMEOUT + 30)
    assert {d[0] for d in deleted} == set(stages.STAGES) and len(deleted) == len(stages.STAGES) + 1, deleted
    for stage, index, name in deleted:
        again = [p for p in _stage_pods(rig, runs_ns, out3, stage)
                 if int(p["metadata"]["labels"][INDEX_LABEL]) == index]
        assert [p["status"]["phase"] for p in again] == ["Succeeded"] and again[0]["metadata"]["name"] != name, again
    jobs = json.loads(rig.kubectl("get", "jobs", "-n", runs_ns, "-l", selector, "-o", "json").stdout)
    assert all(j["status"].get("succeeded") == j["spec"]["completions"] for j in jobs["items"])
    # every pod ran on the real node (the --spec's nodeSelector and toleration)
    nodes = {p["spec"].get("nodeName") for s in stages.STAGES for p in _stage_pods(rig, runs_ns, out3, s)}
    assert nodes == {real_node.name}, nodes

    got = {}
    for out in ("w1/", "w3/"):
        got[out] = {o.key.removeprefix(out): store.get_bytes(o.key) for o in store.list(out)
                    if not o.key.startswith(out + "work/")}
    assert got["w1/"] == got["w3/"]
    manifest = json.loads(got["w3/"].pop("manifest.json"))
    assert manifest["removed"] == planted and manifest["documents_in"] == 4 * 6 + 4

    one.prepare([str(tmp_path / "src")], output=f"file://{tmp_path / 'one'}", log=lambda *_: None,
                **settings(tokenizer_file, "minhash"))
    want = outputs(tmp_path / "one")
    want_manifest = json.loads(want.pop("manifest.json"))
    assert got["w3/"] == want  # shards and document starts byte for byte
    for m in (manifest, want_manifest):
        m.pop("inputs"), m.pop("tokenizer"), m.pop("partitions", None)
    assert manifest == want_manifest
