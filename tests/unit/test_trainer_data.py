"""The data loader: seeded order, per-rank slices of each global batch, a resumable cursor, the sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kiln.errors import KilnError
from kiln.trainer.data.loader import GlobalBatchLoader, SyntheticSamples, open_source, pydoc_bytes


def pydoc(seq_len=64, split="train"):
    return open_source("builtin:pydoc", seq_len=seq_len, vocab_size=256, seed=0, split=split)


def test_builtin_corpus_is_english_text_split_into_train_and_validation():
    raw = pydoc_bytes()
    assert len(raw) > 400_000 and b"the" in raw
    train, val = pydoc(), pydoc(split="validation")
    assert len(train) > 5 * len(val) > 0
    x = train.get(0)
    assert x.shape == (65,) and x.dtype == torch.int64 and int(x.max()) < 256
    assert bytes(x.tolist()) in raw


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = (GlobalBatchLoader(pydoc(), seed=s) for s in (1, 1, 2))
    for _ in range(3):
        xa, ya = a.next_batch(8)
        xb, _ = b.next_batch(8)
        xc, _ = c.next_batch(8)
        assert torch.equal(xa, xb) and not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one


def test_cursor_resumes_exactly():
    a = GlobalBatchLoader(pydoc(), seed=5)
    for _ in range(3):
        a.next_batch(8)
    state = a.state_dict()
    expected = a.next_batch(8)
    b = GlobalBatchLoader(pydoc(), seed=5)
    b.load_state_dict(state)
    assert all(torch.equal(e, g) for e, g in zip(expected, b.next_batch(8)))


def test_resume_with_another_seed_is_refused():
    a = GlobalBatchLoader(pydoc(), seed=5)
    with pytest.raises(KilnError, match="seed"):
        GlobalBatchLoader(pydoc(), seed=6).load_state_dict(a.state_dict())


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_ranks_split_the_same_global_batch(dp):
    whole = GlobalBatchLoader(pydoc(), seed=0).next_batch(8)[0]
    parts = [GlobalBatchLoader(pydoc(), seed=0, dp_rank=r, dp_size=dp).next_batch(8)[0] for r in range(dp)]
    assert torch.equal(torch.cat(parts), whole)


def test_an_epoch_visits_every_sample_once():
    src = open_source("builtin:pydoc", seq_len=4096, vocab_size=256, seed=0)
    n = len(src)
    loader = GlobalBatchLoader(src, seed=0)
    ids = [loader._sample_id(i) for i in range(n)]
    assert sorted(ids) == list(range(n))
    assert [loader._sample_id(i) for i in range(n, 2 * n)] != ids  # the next epoch reshuffles


def test_token_shards_from_a_folder(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(0, 100, dtype=np.int32))
    np.arange(100, 150, dtype="<u2").tofile(tmp_path / "b.bin")
    src = open_source(f"file://{tmp_path}", seq_len=9, vocab_size=1000, seed=0)
    assert len(src) == 11 + 5  # non-overlapping windows of 10 tokens, stride 9, per shard
    assert src.get(0).tolist() == list(range(10))
    assert src.get(11).tolist() == list(range(100, 110))


@pytest.mark.parametrize(
    "uri,message",
    [("file:///nonexistent/shards", "no such folder"), ("builtin:pydoc", "vocabSize")],
)
def test_bad_data_uri_is_a_clear_error(uri, message):
    with pytest.raises(KilnError, match=message):
        open_source(uri, seq_len=8, vocab_size=100, seed=0)


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(KilnError, match=r"no \*\.npy or \*\.bin"):
        open_source(str(tmp_path), seq_len=8, vocab_size=100, seed=0)


def test_synthetic_samples_are_a_function_of_seed_and_index():
    a, b = SyntheticSamples(16, 50, seed=1), SyntheticSamples(16, 50, seed=1)
    assert torch.equal(a.get(7), b.get(7)) and not torch.equal(a.get(7), a.get(8))
    assert int(a.get(3).max()) < 50


@pytest.mark.rig
def test_token_shards_from_s3_are_cached_locally(rig, tmp_path, monkeypatch):
    import uuid

    from kiln.storage import open_store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rig.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rig.s3_secret_key)
    monkeypatch.setenv("KILN_DATA_CACHE", str(tmp_path / "cache"))
    uri = f"s3://{rig.s3_bucket}/tokens-{uuid.uuid4().hex[:8]}/"
    store = open_store(uri, endpoint=rig.s3_endpoint)
    np.save(tmp_path / "a.npy", np.arange(0, 100, dtype=np.int32))
    store.put_file("a.npy", tmp_path / "a.npy")
    src = open_source(uri, seq_len=9, vocab_size=1000, seed=0, endpoint=rig.s3_endpoint)
    assert len(src) == 11 and src.get(10).tolist() == list(range(90, 100))
    assert len(list((tmp_path / "cache").rglob("a.npy"))) == 1
    with pytest.raises(KilnError, match="no \\*\\.npy"):
        open_source(uri + "empty/", seq_len=9, vocab_size=1000, seed=0, endpoint=rig.s3_endpoint)


def test_the_trainer_reads_shards_without_importing_the_chat_and_prepare_code():
    # A restarted rank pays every import again before step 1 (docs/resilience.md): data.py takes the shard names
    # from kiln.trainer.data.shards, not from prepare, which pulls in chat and jinja2.
    import subprocess
    import sys

    probe = ("import sys, kiln.trainer.run; print(sorted(m for m in ('jinja2', 'kiln.trainer.data.chat', "
             "'kiln.trainer.data.prepare') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
