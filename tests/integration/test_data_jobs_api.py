"""The apiserver (the oracle for what a Job may be) accepts every stage's Indexed Job as `kiln data prepare --workers`
renders it, and its defaulting keeps the fields the retry and slicing depend on (server-side dry run)."""

from __future__ import annotations

import pytest

from kiln.cli import data_jobs
from kiln.trainer.data import stages

pytestmark = pytest.mark.rig


def test_the_apiserver_accepts_every_stage_job(rig, namespace):
    from kubernetes import client

    from kiln.control.kube import api_client

    batch = client.BatchV1Api(api_client(str(rig.kubeconfig)))
    js = data_jobs.JobSettings(namespace=namespace, image="ghcr.io/kiln-dev/kiln-trainer:0.1.0",
                               output="s3://data/out/", endpoint="http://minio:9000", credentials_secret="s3-keys",
                               node_selector={"pool": "data"}, tolerations=[
                                   {"key": "kiln.dev/pool", "operator": "Equal", "value": "data",
                                    "effect": "NoExecute", "tolerationSeconds": 30}])
    for stage in stages.STAGES:
        job = data_jobs.render_job(js, stage, completions=5, workers=3)
        made = batch.create_namespaced_job(namespace, job, dry_run="All")
        assert (made.spec.completion_mode, made.spec.completions, made.spec.parallelism) == ("Indexed", 5, 3)
        assert made.spec.backoff_limit_per_index == data_jobs.BACKOFF_PER_INDEX
        assert made.spec.template.spec.containers[0].args[0] == stage
        assert made.spec.template.spec.node_selector == {"pool": "data"}
        assert made.spec.template.spec.tolerations[0].toleration_seconds == 30
