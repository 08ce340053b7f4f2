"""A TrainingSpec with replica groups and its rendered objects (the control-plane tests of replica groups, the
per-run secret and authenticated healing)."""

from __future__ import annotations

import copy
import socket
import sys
from pathlib import Path

from kiln.api.load import parse
from kiln.control.config import OperatorConfig
from kiln.control.plan import plan

UID = "5b1c8e0c-0000-4000-8000-000000000002"
GROUPS = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
    "metadata": {"name": "ft", "namespace": "ml", "uid": UID},
    "spec": {
        "model": {"preset": "llama-1b"},
        "training": {"steps": 100, "globalBatchSize": 64, "microBatchSize": 2},
        "parallelism": {"tensor": 2},
        "resources": {"nodes": 4, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"},
        "elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 2}},
        "checkpoint": {"uri": "s3://ckpt/ft/", "endpoint": "http://s3:9000", "credentialsSecret": "s3"},
    },
}
CONFIG = OperatorConfig(image="registry.test/trainer:1")
LIGHTHOUSE = str(Path(sys.executable).with_name("kiln-lighthouse"))  # this environment's console script


def rendered(raw: dict = GROUPS) -> list[dict]:
    result = plan(parse(copy.deepcopy(raw)), None, CONFIG)
    assert result.refused is None, result.refused
    return result.objects


def of(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
