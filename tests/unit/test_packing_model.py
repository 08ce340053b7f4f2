"""Packed rows in the model (kiln.trainer.model.documents): a packed row's logits and loss are those of its
documents run one by one, no token sees another document, and FlexAttention's block mask keeps the same rule as
the dense mask the CPU runs with."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from kiln.api import ModelDims
from kiln.trainer.data.packing import pack_row
from kiln.trainer.model.documents import block_mask, dense_mask, positions
from kiln.trainer.model.loss import IGNORE
from kiln.trainer.model.transformer import attend, build_model

DIMS = ModelDims(dim=32, layers=2, heads=4, kv_heads=2, vocab_size=64, seq_len=32, ffn_dim=48)
CAPACITY = DIMS.seq_len + 1
LENGTHS = [9, 5, 12, 3]  # 29 tokens of 33: the row ends in 4 tokens of padding


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(DIMS)
    m.to_empty(device="cpu")
    m.init_weights(0)
    m.fused_loss = False  # logits through the same path the per-document reference takes
    return m.eval()


def documents(seed=0) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [gen.integers(1, DIMS.vocab_size, n) for n in LENGTHS]


def packed(docs):
    inputs, targets, doc_ids = pack_row(docs, None, CAPACITY)
    return inputs[None], targets[None], doc_ids[None]


def test_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, 3]])
    assert positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]


def test_pack_row_targets_stay_inside_each_document():
    inputs, targets, doc_ids = pack_row([np.array([5, 6, 7]), np.array([8, 9])], None, 8)
    assert inputs.tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert targets.tolist() == [6, 7, IGNORE, 9, IGNORE, IGNORE, IGNORE]  # no target across a boundary or in padding
    assert doc_ids.tolist() == [0, 0, 0, 1, 1, -1, -1]  # padding: a document of its own


def test_packed_logits_and_loss_equal_the_documents_run_one_by_one(model):
    docs = documents()
    inputs, targets, doc_ids = packed(docs)
    with torch.no_grad():
        logits = model(inputs, doc_ids=doc_ids)[0]
        loss = model(inputs, targets, doc_ids=doc_ids)
        at, total, count = 0, 0.0, 0
        for doc in docs:
            alone = torch.from_numpy(doc)[None]
            ref = model(alone[:, :-1])[0]
            torch.testing.assert_close(logits[at:at + len(doc) - 1], ref, atol=1e-5, rtol=1e-5)
            # the mean over every document's predictions: token-weighted, as kiln's global-token loss is
            total += float(model(alone[:, :-1], alone[:, 1:])) * (len(doc) - 1)
            count += len(doc) - 1
            at += len(doc)
    assert int((targets != IGNORE).sum()) == count
    assert float(loss) == pytest.approx(total / count, rel=1e-6)


def test_no_token_attends_to_another_document(model):
    docs = documents()
    inputs, _, doc_ids = packed(docs)
    changed = [docs[0] % (DIMS.vocab_size - 1) + 1] + docs[1:]  # every token of the first document differs
    perturbed = packed(changed)[0]
    assert not torch.equal(inputs, perturbed)
    later = slice(LENGTHS[0], sum(LENGTHS))
    with torch.no_grad():
        kept = model(inputs, doc_ids=doc_ids)[0, later]
        torch.testing.assert_close(model(perturbed, doc_ids=doc_ids)[0, later], kept, atol=0, rtol=0)
        # the check has teeth: without the document mask the first document does reach the others
        assert not torch.allclose(model(perturbed)[0, later], model(inputs)[0, later], atol=1e-4)


def test_flex_block_mask_keeps_the_dense_masks_rule():
    """FlexAttention (the CUDA path) with the block mask equals SDPA with the dense mask; eager flex runs here."""
    gen = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * 128])
    q, k, v = (torch.randn(2, 4, 128, 16, generator=gen) for _ in range(3))
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile": the eager path, on purpose
        flex = flex_attention(q, k, v, block_mask=block_mask(doc_ids))
    dense = attend(q, k, v, docs=dense_mask(doc_ids))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense[1], attend(q, k, v)[1], atol=1e-6, rtol=1e-6)  # one document: causal


def test_packed_rows_keep_a_familys_sliding_window_and_soft_capping():
    """A Gemma-2-like model (sliding layers with a window shorter than a document, soft-capped scores and logits,
    its own local RoPE base): packed logits still equal each document run alone."""
    from kiln.api.presets import Arch

    arch = Arch(family="gemma2", sliding_window=4, sliding_layers=(0,), attn_softcap=20.0, final_softcap=10.0,
                local_rope_theta=1000.0, sandwich_norm=True, norm_offset=1.0, embed_scale=True)
    dims = DIMS.model_copy(update={"arch": arch})
    torch.manual_seed(0)
    m = build_model(dims)
    m.to_empty(device="cpu")
    m.init_weights(0)
    docs = documents(1)
    inputs, _, doc_ids = packed(docs)
    with torch.no_grad():
        logits = m(inputs, doc_ids=doc_ids)[0]
        at = 0
        for doc in docs:
            ref = m(torch.from_numpy(doc)[None, :-1])[0]
            torch.testing.assert_close(logits[at:at + len(doc) - 1], ref, atol=1e-5, rtol=1e-5)
            at += len(doc)
