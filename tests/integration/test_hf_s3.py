"""A Hugging Face folder in the rig's real S3 server (versitygw): imported by ranged reads (kiln's logits equal
transformers'), saved as a kiln checkpoint, exported back to S3 with `kiln export`, and the exported tensors
are the very tensors of the source."""

from __future__ import annotations


import pytest

import torch
import yaml

from kiln.storage import open_store
from tests.hf_models import VOCAB, save_model
from tests.support.s3 import s3_prefix  # noqa: F401 - fixture

pytestmark = [pytest.mark.rig, pytest.mark.slow]


def test_import_from_s3_and_export_to_s3_round_trip(rig, s3_prefix, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kiln.api.load import load_file as load_spec
    from kiln.api.spec import CheckpointSpec
    from kiln.cli.main import main
    from kiln.trainer.checkpoint.checkpointer import Checkpointer
    from kiln.trainer.evaluate import initial_model
    from kiln.trainer.model.hf_folder import resolve_dims

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


def test_chat_data_prepared_from_s3_to_s3_reads_back_with_its_masks(rig, s3_prefix, tmp_path, monkeypatch):
    """kiln data prepare --format chat with the model folder (chat template in tokenizer_config.json), the
    conversations and the output all in S3; the trainer's source fetches tokens and masks from S3 and gives the
    same batches as a local prepare of the same files."""
    import json

    from kiln.cli.main import main
    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from tests.chat_models import CONVERSATIONS, save_chat_folder

    model = save_chat_folder(tmp_path / "model")
    (tmp_path / "src").mkdir()
    lines = [json.dumps({"messages": [{**m, "content": f"{m['content']} {i}"} for m in c]})
             for i in range(20) for c in CONVERSATIONS]
    (tmp_path / "src" / "chat.jsonl").write_text("\n".join(lines))
    for folder, prefix in ((model, "model/"), (tmp_path / "src", "src/")):
        store = open_store(s3_prefix + prefix, endpoint=rig.s3_endpoint)
        for f in folder.iterdir():
            store.put_file(f.name, f)
    common = ["data", "prepare", "--format", "chat", "--shard-tokens", "500"]
    assert main(common + ["--input", s3_prefix + "src/", "--tokenizer", s3_prefix + "model/",
                          "--output", s3_prefix + "out/", "--endpoint", rig.s3_endpoint]) == 0
    assert main(common + ["--input", str(tmp_path / "src"), "--tokenizer", f"file://{model}",
                          "--output", f"file://{tmp_path / 'local'}"]) == 0
    names = {o.key for o in open_store(s3_prefix + "out/", endpoint=rig.s3_endpoint).list()}
    assert {"manifest.json", "tokens-00000.npy", "mask-00000.npy", "tokens-00001.npy", "mask-00001.npy"} <= names
    monkeypatch.setenv("KILN_DATA_CACHE", str(tmp_path / "cache"))
    batches = []
    for uri in (s3_prefix + "out/", f"file://{tmp_path / 'local'}"):
        source = open_source(uri, seq_len=16, vocab_size=384, seed=0, endpoint=rig.s3_endpoint, chat=True)
        batches.append(GlobalBatchLoader(source, seed=0).next_batch(8))
    assert all(torch.equal(a, b) for a, b in zip(*batches))
    assert (batches[0][1] == -100).any() and (batches[0][1] != -100).any()


def test_text_data_is_prepared_from_s3_in_ranged_reads(rig, s3_prefix, tmp_path, monkeypatch):
    """kiln data prepare streams s3:// inputs in ranged GETs (kiln.storage.reader), none of them a whole file:
    .jsonl (with a line past --max-doc-bytes), .txt and a parquet file of many row groups give the same
    manifest and shards as the same files prepared locally."""
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.storage import reader
    from kiln.storage.s3 import S3Store
    from kiln.trainer.data.prepare import prepare
    from tests.hf_models import make_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    texts = [f"Paragraph {i}: " + "words of the corpus " * (i % 7 + 1) for i in range(3000)]
    (src / "a.jsonl").write_text("\n".join([json.dumps({"text": t}) for t in texts[:1000]]
                                           + [json.dumps({"text": "z" * (1 << 20)})]  # too_large
                                           + [json.dumps({"text": t}) for t in texts[:1000:3]]))  # duplicates
    (src / "b.txt").write_text("One document, a whole text file.")
    pq.write_table(pa.table({"text": texts[1000:]}), src / "c.parquet", row_group_size=100)
    store = open_store(s3_prefix + "src/", endpoint=rig.s3_endpoint)
    for f in src.iterdir():
        store.put_file(f.name, f)
    monkeypatch.setattr(reader, "CHUNK", 64 << 10)
    reads: list[int] = []
    real_get = S3Store.get_bytes

    def recorded(self, key, offset=0, length=None):
        data = real_get(self, key, offset, length)
        if key.startswith(tuple(f.name for f in src.iterdir())):
            reads.append(len(data))
        return data

    monkeypatch.setattr(S3Store, "get_bytes", recorded)
    common = dict(tokenizer_uri=f"file://{tmp_path / 'tokenizer.json'}", shard_tokens=5000,
                  max_doc_bytes=256 << 10, log=lambda m: None)
    remote = prepare([s3_prefix + "src/"], output=f"file://{tmp_path / 'from-s3'}", endpoint=rig.s3_endpoint,
                     **common)
    local = prepare([str(src)], output=f"file://{tmp_path / 'local'}", **common)
    assert remote.removed == local.removed == {"duplicate": 334, "too_large": 1}
    assert (remote.documents_out, remote.tokens) == (local.documents_out, local.tokens) == (3001, local.tokens)
    for a, b in zip(remote.shards, local.shards, strict=True):
        assert np.array_equal(np.load(tmp_path / "from-s3" / a["name"]), np.load(tmp_path / "local" / b["name"]))
    largest_file = max(f.stat().st_size for f in src.iterdir())
    assert len(reads) > 3 * len(list(src.iterdir())) and max(reads) <= (256 << 10) + 1 < largest_file
