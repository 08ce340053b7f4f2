"""TrainingSpec documents the tests start from: BASE (a valid GPU spec that a case breaks in one way) and
with_, a document as the operator receives it (doc_of), a small run for the rig (small_run), and the CRD's
integer fields with a valid document around one of them (SPEC_INTS, doc_with)."""

from __future__ import annotations

import copy

from kiln.api.crd import crd
from kiln.api.load import parse


# A valid GPU spec that a test case breaks in exactly one way (with_).
BASE = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "base"},
    "spec": {
        "model": {"preset": "llama-1b"},
        "training": {"steps": 100, "globalBatchSize": 64, "microBatchSize": 2},
        "parallelism": {"tensor": 2, "pipeline": 2},
        "resources": {"nodes": 2, "gpusPerNode": 8, "gpuType": "NVIDIA-H200"},
        "elastic": {"minNodes": 1, "maxNodes": 4, "plan": [{"untilStep": 10, "nodes": 1}, {"nodes": 4}]},
        "checkpoint": {"uri": "s3://ckpt/base/", "endpoint": "http://s3:9000", "credentialsSecret": "s3"},
    },
}


def with_(changes: dict) -> dict:
    """BASE with `changes` ({'parallelism.tensor': 3, ...}; None deletes the key)."""
    doc = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = doc["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


UID = "5b1c8e0c-0000-4000-8000-000000000001"


def doc_of(raw: dict, namespace: str = "ml"):
    raw = copy.deepcopy(raw)
    raw["metadata"].update({"namespace": namespace, "uid": UID})
    return parse(raw)


def worker(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]


def integer_fields(node: dict, path: str = "spec"):
    """(path, schema) of every integer in a CRD schema; list items as `[]`."""
    if node.get("type") == "integer":
        yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from integer_fields(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from integer_fields(node["items"], path + "[]")


CRD_ROOT = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
SPEC_INTS = dict(integer_fields(CRD_ROOT["spec"]))


def doc_with(path: str, value) -> dict:
    """A valid document with `path` (a CRD path, `[]` for the first list item) set to `value`."""
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "bounds"}, "spec": {}}
    node = doc
    parts = path.split(".")
    for key in parts[:-1]:
        if key.endswith("[]"):
            node = node.setdefault(key[:-2], [{}])[0]
        else:
            node = node.setdefault(key, {})
    node[parts[-1]] = value
    if path.startswith("spec.elastic.plan[]"):
        node.setdefault("nodes", 1)
    return doc


def small_run(name: str, **spec) -> dict:
    """A tiny GPU run (1 GPU per node) so that several fit on the rig's kwok nodes at once."""
    body = {"model": {"preset": "tiny"}, "data": {"uri": "synthetic"},
            "training": {"steps": 100, "globalBatchSize": 8, "microBatchSize": 1},
            "resources": {"nodes": 1, "gpusPerNode": 1, "gpuType": "NVIDIA-H200"},
            "checkpoint": {"uri": "file:///ckpt/"}}
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": name}, "spec": body}


# A model smaller than the `tiny` preset, so a 4-rank gloo run of a few steps takes seconds on two cores.
MICRO_MODEL = {"preset": "tiny", "dim": 64, "layers": 2, "heads": 4, "kvHeads": 2, "seqLen": 32, "ffnDim": 128}
# MICRO_MODEL's attention with 4 experts (top-2) in every layer, and both router losses on: the MoE layout tests'.
MICRO_MOE_MODEL = {**MICRO_MODEL, "moe": {"experts": 4, "topK": 2, "ffnDim": 32, "auxLossCoef": 0.01,
                                          "zLossCoef": 0.001}}
