"""A Hugging Face folder in the rig's real S3 server (versitygw): imported by ranged reads (kiln's logits equal
transformers'), saved as a kiln checkpoint, exported back to S3 with `kiln export`, and the exported tensors
are the very tensors of the source."""

from __future__ import annotations

import uuid

import pytest
import torch
import yaml

from kiln.storage import open_store
from tests.hf_models import VOCAB, save_model

pytestmark = [pytest.mark.rig, pytest.mark.slow]


@pytest.fixture
def s3_prefix(rig, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rig.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rig.s3_secret_key)
    uri = f"s3://{rig.s3_bucket}/test-hf/{uuid.uuid4().hex}/"
    yield uri
    open_store(uri, endpoint=rig.s3_endpoint).delete_prefix("")


def test_import_from_s3_and_export_to_s3_round_trip(rig, s3_prefix, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kiln.api.load import load_file as load_spec
    from kiln.api.spec import CheckpointSpec
    from kiln.cli.main import main
    from kiln.trainer.checkpoint import Checkpointer
    from kiln.trainer.evaluate import initial_model
    from kiln.trainer.hf import resolve_dims

    local = tmp_path / "local"
    reference = save_model(local, "llama3", max_shard_size="20KB")  # sharded, with an index and a tokenizer
    store = open_store(s3_prefix + "base/", endpoint=rig.s3_endpoint)
    for f in local.iterdir():
        store.put_file(f.name, f)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "from-s3"},
        "spec": {"model": {"from": s3_prefix + "base/", "seqLen": 32},
                 "training": {"precision": "fp32", "globalBatchSize": 2},
                 "parallelism": {"compile": False, "kernels": "reference"},
                 "checkpoint": {"uri": f"file://{tmp_path / 'ckpt'}", "endpoint": rig.s3_endpoint}}}))
    doc = load_spec(spec)[0]
    dims = resolve_dims(doc.spec)  # config.json from S3
    model = initial_model(doc, dims, torch.device("cpu"))  # weights by ranged reads from S3
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)

    ckpt = Checkpointer(CheckpointSpec(uri=f"file://{tmp_path / 'ckpt'}"), default_uri="", rank=0, world_size=1)
    ckpt.save(1, [model], [], {"step": 1}, final=True)
    ckpt.close()
    assert main(["export", str(spec), "--output", s3_prefix + "out/", "--endpoint", rig.s3_endpoint,
                 "--max-shard-size", "30KB"]) == 0
    out = open_store(s3_prefix + "out/", endpoint=rig.s3_endpoint)
    names = {o.key for o in out.list()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= names
    exported = {}
    for key in sorted(n for n in names if n.endswith(".safetensors")):
        out.get_file(key, tmp_path / key)
        exported.update(load_file(str(tmp_path / key)))
    for f in local.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                assert torch.equal(exported[name], st.get_tensor(name)), name
