"""Packed rows on the data side (kiln.trainer.data.packing): kiln data prepare records where documents start (checked
against the `tokenizers` library's own encoding), the rows hold every document's tokens exactly once, whole
conversations keep transformers' assistant masks, the plan is a pure function of the seed, the loader's resume and
data-parallel split still hold, and bad input is one line naming the field or the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.api import TrainingSpec
from kiln.errors import KilnError
from kiln.trainer.data.loader import GlobalBatchLoader, open_source
from kiln.trainer.data.packing import plan_rows
from kiln.trainer.data.prepare import prepare
from kiln.trainer.model.loss import IGNORE
from tests.chat_models import save_chat_folder, transformers_encoding
from tests.hf_models import save_eos_tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return save_eos_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


TEXTS = [f"Document {i}: " + "the loader packs whole documents " * (i % 7) + "and stops." for i in range(30)]


def segments(inputs, targets, doc_ids):
    """Each non-padding document of a packed row as (its tokens, its targets), from the row's tensors."""
    out = []
    for doc in doc_ids.unique().tolist():
        where = (doc_ids == doc).nonzero().flatten()
        seg_inputs, seg_targets = inputs[where], targets[where]
        if (seg_targets == IGNORE).all():
            continue  # padding (a document of one token has no prediction and is never packed)
        assert torch.equal(seg_inputs[1:], seg_targets[:-1])  # a document's targets are its own next tokens
        tokens = [int(seg_inputs[0])] + [int(t) for t in seg_targets if t != IGNORE]
        out.append((tuple(tokens), seg_targets))
    return out


def test_text_rows_hold_every_document_piece_once(tmp_path, tokenizer_file):
    from tokenizers import Tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    out = tmp_path / "out"
    prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{out}", eos="<eos>",
            shard_tokens=50, log=lambda m: None)  # documents run on across shards of 50 tokens
    tok = Tokenizer.from_file(str(tokenizer_file))
    docs = [tok.encode(t, add_special_tokens=False).ids + [tok.token_to_id("<eos>")] for t in TEXTS]

    # the document starts kiln data prepare wrote are the tokenizer's document boundaries
    shards = sorted(out.glob("tokens-*.npy"))
    sizes = [len(np.load(f)) for f in shards]
    starts = np.concatenate([np.load(f.with_name(f.name.replace("tokens-", "docs-")).with_suffix(".idx")) + offset
                             for f, offset in zip(shards, np.cumsum([0] + sizes[:-1]))])
    assert starts.tolist() == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist()

    seq = 24  # some documents are longer than a row: pieces of seq + 1 tokens overlapping by one
    want = sorted(tuple(d[j * seq:j * seq + seq + 1]) for d in docs for j in range(-(-(len(d) - 1) // seq)))
    source = open_source(f"file://{out}", seq_len=seq, vocab_size=400, seed=3, packing=True)
    loader = GlobalBatchLoader(source, seed=3)
    inputs, targets, doc_ids = loader.next_batch(len(source))
    assert inputs.shape == targets.shape == doc_ids.shape == (len(source), seq)
    got = sorted(piece for row in zip(inputs, targets, doc_ids) for piece, _ in segments(*row))
    assert got == want
    assert int((targets != IGNORE).sum()) == sum(len(d) - 1 for d in docs)  # every prediction once
    assert len(source) < sum(len(d) for d in docs) / seq * 1.15  # rows are nearly full


def test_chat_rows_keep_conversations_whole_with_transformers_masks(tmp_path):
    folder = save_chat_folder(tmp_path / "model")
    conversations = [[{"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": "Answer " + "and more " * (i % 4) + f"{i}."}]
                     for i in range(12)]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "c.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in conversations))
    out = tmp_path / "out"
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{folder}", output=f"file://{out}", format="chat",
            shard_tokens=40, log=lambda m: None)
    want = {}
    for c in conversations:
        ids, mask = transformers_encoding(folder, c)
        want[tuple(ids)] = np.where(np.array(mask[1:]) == 1, ids[1:], IGNORE).tolist()
    seq = 64
    source = open_source(f"file://{out}", seq_len=seq, vocab_size=400, seed=0, chat=True, packing=True)
    inputs, targets, doc_ids = GlobalBatchLoader(source, seed=0).next_batch(len(source))
    seen = {}
    for row_inputs, row_targets, row_docs in zip(inputs, targets, doc_ids):
        for doc in row_docs.unique().tolist():
            where = (row_docs == doc).nonzero().flatten()
            ids = tuple(row_inputs[where].tolist())  # a conversation that ends the row has its last token as a target
            match = [key for key in want if key[:len(ids)] == ids and len(ids) >= len(key) - 1]
            if match:
                seen[match[0]] = row_targets[where].tolist()
    # every conversation whole in one row, its targets transformers' assistant tokens (its last token predicts nothing)
    assert seen == {ids: (masked + [IGNORE])[:len(seen.get(ids, ()))] for ids, masked in want.items()}
    assert all(len(seen[ids]) >= len(ids) - 1 for ids in want)

    with pytest.raises(KilnError) as err:  # a conversation that cannot fit a row: the field and the shard named
        open_source(f"file://{out}", seq_len=16, vocab_size=400, seed=0, chat=True, packing=True)
    assert str(err.value).startswith("model.seqLen 16: data.packing keeps conversations whole")
    assert "tokens-00000.npy at token 0" in str(err.value) and "\n" not in str(err.value)


def test_plan_is_a_pure_function_of_the_seed_and_fits_every_piece_once():
    lengths = np.random.default_rng(0).integers(2, 120, 2000)
    order, bounds = plan_rows(lengths, 256, seed=5)
    again = plan_rows(lengths, 256, seed=5)
    assert np.array_equal(order, again[0]) and np.array_equal(bounds, again[1])
    assert sorted(order.tolist()) == list(range(2000))
    fill = [int(lengths[order[a:b]].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    assert max(fill) <= 256 and sum(fill) / (256 * len(fill)) > 0.97
    assert not np.array_equal(plan_rows(lengths, 256, seed=6)[0], order)


def test_resume_and_data_parallel_slices_see_the_same_rows(tmp_path, tokenizer_file):
    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{tmp_path / 'out'}",
            log=lambda m: None)
    uri = f"file://{tmp_path / 'out'}"

    def loader(dp_rank=0, dp_size=1):
        return GlobalBatchLoader(open_source(uri, seq_len=32, vocab_size=400, seed=1, packing=True), seed=1,
                                 dp_rank=dp_rank, dp_size=dp_size)

    whole = loader()
    whole.next_batch(4)
    second = whole.next_batch(4)
    halves = [loader(r, 2) for r in range(2)]
    for half in halves:
        half.load_state_dict({"samples_seen": 4, "seed": 1})  # resumed after the first step, at another world
    parts = [half.next_batch(4) for half in halves]
    for k in range(3):
        assert torch.equal(torch.cat([parts[0][k], parts[1][k]]), second[k])


def test_unprepared_or_damaged_boundaries_and_unpackable_uris_are_refused(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    np.save(folder / "tokens-00000.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(KilnError, match=r"tokens-00000.npy has no docs-00000.idx: data.packing needs"):
        open_source(f"file://{folder}", seq_len=8, vocab_size=400, seed=0, packing=True)
    with open(folder / "docs-00000.idx", "wb") as f:
        np.save(f, np.array([0, 40, 20]))
    with pytest.raises(KilnError, match=r"docs-00000.idx must hold increasing token offsets inside tokens-00000.npy"):
        open_source(f"file://{folder}", seq_len=8, vocab_size=400, seed=0, packing=True)
    with pytest.raises(Exception) as err:
        TrainingSpec.model_validate({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec",
                                     "metadata": {"name": "p"},
                                     "spec": {"data": {"uri": "synthetic", "packing": True}}})
    assert "spec.data.packing: data.packing packs the documents of shards prepared with kiln data prepare" \
        in str(err.value)


def test_mixed_sources_pack_each_source_and_keep_the_mix(tmp_path):
    """data.sources with packing: each source's rows are its own documents, drawn in the mix's proportions."""
    from kiln.api.spec import DataSpec
    from kiln.trainer.data.loader import open_data

    for name, fill, length in (("web", 1, 5), ("code", 2, 7)):  # 60 documents of one token value each
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "tokens-00000.npy", np.full(60 * length, fill, dtype=np.uint16))
        with open(tmp_path / name / "docs-00000.idx", "wb") as f:
            np.save(f, np.arange(0, 60 * length, length))
    data = DataSpec.model_validate({"packing": True, "sources": [{"uri": f"file://{tmp_path}/web/", "weight": 1},
                                                                 {"uri": f"file://{tmp_path}/code/", "weight": 1}]})
    loader = GlobalBatchLoader(open_data(data, seq_len=15, vocab_size=8, seed=0), seed=0)
    inputs, targets, doc_ids = loader.next_batch(1000)
    for row_inputs, row_docs in zip(inputs, doc_ids):
        real = row_inputs[row_docs != -1]
        assert len(set(real.tolist())) == 1  # one source's documents per row
        assert len(real) == {1: 15, 2: 14}[int(real[0])]  # three of 5 tokens (+ 1 padding), two of 7
    assert loader.mix() == {f"file://{tmp_path}/web/": 0.5, f"file://{tmp_path}/code/": 0.5}


def test_shards_fetched_from_a_store_bring_their_document_starts(tmp_path, tokenizer_file):
    """fetch_shards (what an s3:// data.uri goes through) copies docs-N.idx with the shards (from a file:// store)."""
    from kiln.trainer.data.loader import fetch_shards

    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{tmp_path / 'out'}",
            shard_tokens=100, log=lambda m: None)
    cached = fetch_shards(f"file://{tmp_path / 'out'}/", cache_root=str(tmp_path / "cache"))
    written = sorted(p.name for p in (tmp_path / "out").glob("docs-*"))
    assert written and sorted(p.name for p in cached.glob("docs-*.idx")) == written
    rows = open_source(str(cached), seq_len=32, vocab_size=400, seed=0, packing=True)
    direct = open_source(f"file://{tmp_path / 'out'}", seq_len=32, vocab_size=400, seed=0, packing=True)
    assert len(rows) == len(direct) and all(torch.equal(a, b) for a, b in zip(rows.row(0), direct.row(0)))
