"""`kiln data prepare --workers N` (kiln.cli.data_jobs): the Indexed Job each stage runs as, the settings a TrainingSpec
gives it, and the CLI's loop over the stages (submit the first unfinished, follow its markers, stop on a failed
Job with one line, clean up), against a batch API whose "pods" are the stage indexes run here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.cli import data_jobs
from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.data import stages
from tests.support.data_stages import outputs, planted_corpus, run_here, settings, tokenizer_file  # noqa: F401

JS = data_jobs.JobSettings(namespace="team-a", image="registry.example/kiln-trainer:site", output="s3://data/out/",
                           endpoint="http://minio:9000", credentials_secret="team-s3")


def test_each_stage_is_an_indexed_job_retried_per_index_with_the_keys_by_reference():
    job = data_jobs.render_job(JS, "buckets", completions=9, workers=3)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 9, 3)
    assert spec["backoffLimitPerIndex"] == data_jobs.BACKOFF_PER_INDEX
    assert job["metadata"]["namespace"] == "team-a"
    labels = job["metadata"]["labels"]
    assert labels[data_jobs.STAGE_LABEL] == "buckets" and spec["template"]["metadata"]["labels"] == labels
    (container,) = pod["containers"]
    assert container["image"] == JS.image
    assert container["command"] + container["args"] == ["python", "-m", "kiln.trainer.data.stages", "buckets",
                                                         "s3://data/out/", "--endpoint", "http://minio:9000"]
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert secret_env == {k: {"name": "team-s3", "key": k} for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    # Pod Security `restricted`, as the trainer's pods
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    assert data_jobs.render_job(JS, "cluster", completions=1, workers=3)["spec"]["parallelism"] == 1


def test_a_training_spec_gives_namespace_image_and_s3_settings_and_flags_override(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("apiVersion: kiln.dev/v1alpha1\nkind: TrainingSpec\nmetadata: {name: d, namespace: team-a}\n"
                    "spec:\n  image: registry.example/kiln-trainer:site\n  checkpoint: {uri: 's3://ckpt/r/', "
                    "endpoint: 'http://minio:9000', credentialsSecret: team-s3}\n")
    args = argparse.Namespace(spec=str(spec), namespace=None, image=None, endpoint=None, credentials_secret=None,
                              kubeconfig=None, output="s3://data/out/", tokenizer="s3://tok/t.json",
                              input=["s3://raw/"])
    assert data_jobs.settings_from(args) == JS
    # the run's node pool: its stage pods land where its trainer pods would, and the apiserver's names
    spec.write_text(spec.read_text() + "  resources: {nodeSelector: {pool: data}, tolerations: [{key: kiln.dev/pool, "
                    "operator: Equal, value: data, effect: NoSchedule, tolerationSeconds: 30}]}\n")
    pod = data_jobs.render_job(data_jobs.settings_from(args), "scan", completions=2, workers=2)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "data"}
    assert pod["tolerations"] == [{"key": "kiln.dev/pool", "operator": "Equal", "value": "data", "effect": "NoSchedule",
                                   "tolerationSeconds": 30}]
    assert "nodeSelector" not in data_jobs.render_job(JS, "scan", completions=2, workers=2)["spec"]["template"]["spec"]
    args.namespace, args.image = "team-b", "other:1"
    assert (data_jobs.settings_from(args).namespace, data_jobs.settings_from(args).image) == ("team-b", "other:1")
    args.input = ["/local/folder"]
    with pytest.raises(KilnError, match="^--input /local/folder: with --workers every pod reads"):
        data_jobs.settings_from(args)


def test_cli_refuses_workers_for_chat_in_one_line(capsys):
    assert main(["data", "prepare", "--input", "s3://raw/", "--tokenizer", "s3://t/t.json", "--output",
                 "s3://data/out/", "--workers", "2", "--format", "chat"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workers" in err[0]


class Cluster:
    """BatchV1Api as far as data_jobs uses it; a created Job "runs" every index here (the pods), unless told
    to fail a stage (its Job then reports the Failed condition the Job controller sets)."""

    def __init__(self, output: str, fail: str | None = None):
        self.output, self.fail, self.created, self.deleted = output, fail, [], []

    def create_namespaced_job(self, namespace, job):
        stage = job["metadata"]["labels"][data_jobs.STAGE_LABEL]
        self.created.append(stage)
        if stage != self.fail:
            for i in range(job["spec"]["completions"]):
                stages.run_index(self.output, stage, i)

    def read_namespaced_job(self, name, namespace):
        failed = name.endswith(f"-{self.fail}")
        cond = [SimpleNamespace(type="Failed", status="True", reason="FailedIndexes", message="1 index failed")]
        return SimpleNamespace(status=SimpleNamespace(conditions=cond if failed else [], failed_indexes="0"))

    def list_namespaced_job(self, namespace, label_selector):
        return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=data_jobs.job_name(self.output, s)))
                                      for s in self.created])

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.deleted.append(name)


def test_run_submits_unfinished_stages_in_order_follows_them_and_cleans_up(tmp_path, tokenizer_file):  # noqa: F811
    from kiln.storage import open_store

    planted_corpus(tmp_path / "src")
    out = f"file://{tmp_path / 'out'}"
    plan = stages.plan([str(tmp_path / "src")], out, workers=2, partitions=2, **settings(tokenizer_file, "exact"))
    for i in range(2):  # a rerun after the scan finished: the scan Job is not made again
        stages.run_index(out, "scan", i)
    store = open_store(out)
    js = data_jobs.JobSettings(namespace="ns", image="img", output=out)
    seen = []
    with pytest.raises(KilnError, match=r"^stage tokenize failed \(FailedIndexes: 1 index failed\); .*kubectl logs"):
        data_jobs.run(Cluster(out, fail="tokenize"), store, plan, js, detach=False, keep=False,
                      on_progress=seen.append)
    assert not store.exists("manifest.json") and store.exists(stages.PLAN)  # nothing finished is lost

    cluster = Cluster(out)
    assert data_jobs.run(cluster, store, plan, js, detach=False, keep=False, on_progress=seen.append)
    assert cluster.created == ["tokenize", "shards", "manifest"]
    assert sorted(cluster.deleted) == sorted(data_jobs.job_name(out, s) for s in cluster.created)
    assert not (tmp_path / "out" / "work").exists()
    manifest = json.loads(Path(tmp_path, "out", "manifest.json").read_text())
    assert seen[-1][-1] == {"stage": "manifest", "indexes": 1, "done": 1, "documents": manifest["documents_out"],
                            "bytes": 0, "tokens": manifest["tokens"]}
    # the result equals a run of the same plan with no cluster at all
    here = f"file://{tmp_path / 'here'}"
    stages.plan([str(tmp_path / "src")], here, workers=2, partitions=2, **settings(tokenizer_file, "exact"))
    run_here(here)
    assert outputs(tmp_path / "out") == outputs(tmp_path / "here")


def test_detach_submits_one_stage_and_status_advances_it(tmp_path, tokenizer_file, capsys, monkeypatch):  # noqa: F811
    from kiln.storage import open_store

    planted_corpus(tmp_path / "src")
    out = f"file://{tmp_path / 'out'}"
    plan = stages.plan([str(tmp_path / "src")], out, workers=1, partitions=1, **settings(tokenizer_file, "none"))
    cluster = Cluster(out)
    js = data_jobs.JobSettings(namespace="ns", image="img", output=out)
    assert not data_jobs.run(cluster, open_store(out), plan, js, detach=True, keep=True)
    assert cluster.created == ["scan"]
    monkeypatch.setattr(data_jobs, "_batch", lambda args: cluster)
    for _ in range(3):  # one call per remaining stage
        assert main(["data", "status", "--output", out]) == 0
    assert cluster.created == ["scan", "tokenize", "shards", "manifest"]
    assert "28 of 28 documents" in capsys.readouterr().out
