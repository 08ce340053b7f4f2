"""data.packing across processes: the gradient of a packed global batch under FSDP with accumulation, tensor
parallelism and pipeline parallelism on two gloo ranks equals that of its documents run one by one in a single
process (each alone, its own positions, nothing else to attend to; the loss their token-weighted mean), and
`kiln train` on prepared shards with data.packing gives the same losses on 1 and 2 ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.layout_grads import assert_layouts_match, layout_grads, reference_model
from tests.support.ranks import run_ranks
from tests.support.runs import MICRO_MODEL

pytestmark = [pytest.mark.distributed]

GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 2, 5


def documents(vocab: int, seq: int) -> list[np.ndarray]:
    """Documents of 2 to seq + 1 tokens, mostly short: several to a row."""
    gen = np.random.default_rng(7)
    lengths = np.minimum(gen.geometric(1 / 9, 40) + 1, seq + 1)
    return [gen.integers(0, vocab, n) for n in lengths]


def packed_batch(vocab: int, seq: int) -> tuple[torch.Tensor, ...]:
    from kiln.trainer.data.packing import pack_row, plan_rows

    docs = documents(vocab, seq)
    order, bounds = plan_rows(np.array([len(d) for d in docs]), seq + 1, SEED)
    rows = [pack_row([docs[p] for p in order[a:b]], None, seq + 1) for a, b in zip(bounds[:-1], bounds[1:])]
    assert len(rows) >= GLOBAL_BATCH
    return tuple(torch.stack(parts) for parts in zip(*rows[:GLOBAL_BATCH]))


def one_by_one() -> tuple[float, dict[str, torch.Tensor]]:
    """One process: each document of the packed batch alone; the loss is the sum of every prediction's
    cross-entropy over their count."""
    from kiln.trainer.model.loss import IGNORE

    model, dims = reference_model(GLOBAL_BATCH, MICRO_BATCH, SEED)
    inputs, targets, doc_ids = packed_batch(dims.vocab_size, dims.seq_len)
    total, count = torch.zeros(()), 0
    for row in range(GLOBAL_BATCH):
        for doc in doc_ids[row].unique():
            where = (doc_ids[row] == doc).nonzero().flatten()
            keep = targets[row, where] != IGNORE
            if not keep.any():
                continue  # padding
            alone = inputs[row, where][None]  # the document by itself, at positions 0..n-1
            logits = model(alone)[0]
            total = total + F.cross_entropy(logits[keep], targets[row, where][keep], reduction="sum")
            count += int(keep.sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_packed_gradient_equals_the_documents_one_by_one_in_every_layout(tmp_path):
    losses = run_ranks(layout_grads, 2, tmp_path, str(tmp_path), packed_batch, GLOBAL_BATCH, MICRO_BATCH, SEED,
                       start="spawn")
    want_loss, want = one_by_one()
    assert_layouts_match(losses, tmp_path, want_loss, want)


def test_kiln_train_with_packing_gives_the_same_losses_on_one_and_two_ranks(tmp_path):
    """`kiln data prepare`, then `kiln train` with data.packing on 1 and on 2 ranks: each step reports the global
    batch's loss-carrying tokens as the loader counts them, and the two runs' losses agree."""
    import yaml

    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.data.prepare import prepare
    from tests.support.runs import torchrun_train, write_spec
    from tests.hf_models import save_eos_tokenizer

    save_eos_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "src").mkdir()
    texts = [f"Note {i}: " + "a short document about packing " * (i % 5) for i in range(200)]
    (tmp_path / "src" / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    data = tmp_path / "data"
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{tmp_path / 'tokenizer.json'}", output=f"file://{data}",
            eos="<eos>", log=lambda m: None)
    runs = {}
    for nproc in (1, 2):
        path = write_spec(tmp_path / f"spec-{nproc}.yaml", model={**MICRO_MODEL, "vocabSize": 384},
                          data=f"file://{data}", nproc=nproc, training={"steps": 3})
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["data"].update(packing=True, tokenizer=f"file://{tmp_path / 'tokenizer.json'}")
        path.write_text(yaml.safe_dump(doc))
        runs[nproc] = torchrun_train(path, tmp_path / f"out-{nproc}", nproc)

    loader = GlobalBatchLoader(open_source(f"file://{data}", seq_len=MICRO_MODEL["seqLen"], vocab_size=384, seed=3,
                                           packing=True), seed=3)
    want = [int((loader.next_batch(4)[1] != -100).sum()) for _ in range(3)]
    for nproc, records in runs.items():
        assert [r["loss_tokens"] for r in records] == want, nproc
    assert all(0 < n <= 4 * MICRO_MODEL["seqLen"] for n in want)
    assert [r["loss"] for r in runs[2]] == pytest.approx([r["loss"] for r in runs[1]], rel=1e-4)
