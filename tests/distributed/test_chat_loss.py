"""data.format chat's loss: the mean over the assistant tokens of the whole global batch, whatever the layout.

Two real gloo ranks run the trainer's own step functions (kiln.trainer.parallel.microbatches `accumulate_step` and
`pipeline_step`, with kiln.trainer.model.loss) on one global batch whose assistant tokens are spread
very unevenly over ranks and microbatches (one microbatch has none). Their gradients, gathered by parameter name,
must equal those of the single-process reference: sum of the assistant tokens' cross-entropy / their count, over
the full batch. The mean of per-microbatch means, which equal-weighting would give, differs from it by far more
than the tolerance (checked too, so the comparison can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.layout_grads import assert_layouts_match, layout_grads, reference_model
from tests.support.ranks import run_ranks
from tests.support.runs import MICRO_MODEL

pytestmark = [pytest.mark.distributed]

GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 2, 3


def batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch whose first rows carry one assistant token each, the last rows nearly all, and rows 2-3
    (one microbatch of the dp2 x accumulation-2 layout) none."""
    gen = torch.Generator().manual_seed(11)
    inputs = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=gen)
    targets = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=gen)
    keep = torch.zeros(GLOBAL_BATCH, seq, dtype=torch.bool)
    keep[0, 5] = keep[1, 9] = True
    keep[4:, 2:] = True
    return inputs, targets.masked_fill(~keep, -100)


def reference(*, per_microbatch_mean: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the full batch: sum of assistant-token losses / their count (or, to show the difference,
    the mean of the means of the four microbatches of 2 rows)."""
    model, dims = reference_model(GLOBAL_BATCH, MICRO_BATCH, SEED)
    inputs, targets = batch(dims.vocab_size, dims.seq_len)
    logits = model(inputs).flatten(0, 1)
    token_losses = F.cross_entropy(logits, targets.flatten(), reduction="none").view(GLOBAL_BATCH, -1)
    keep = (targets != -100).float()
    if per_microbatch_mean:
        means = [(token_losses[i:i + 2] * keep[i:i + 2]).sum() / keep[i:i + 2].sum().clamp(min=1)
                 for i in range(0, GLOBAL_BATCH, 2)]
        loss = torch.stack(means).mean()
    else:
        loss = (token_losses * keep).sum() / keep.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_chat_gradient_is_the_global_assistant_token_mean_in_every_layout(tmp_path):
    losses = run_ranks(layout_grads, 2, tmp_path, str(tmp_path), batch, GLOBAL_BATCH, MICRO_BATCH, SEED,
                       start="spawn")
    want_loss, want = reference()
    _, equal_weighting = reference(per_microbatch_mean=True)
    gap = max((equal_weighting[n] - want[n]).abs().max().item() for n in want)
    assert gap > 1e-4, "the batch must tell the global mean from a mean of microbatch means"
    assert_layouts_match(losses, tmp_path, want_loss, want)


def test_kiln_train_takes_the_loss_on_the_prepared_assistant_tokens(tmp_path):
    """`kiln data prepare --format chat`, then `kiln train` with data.format chat on 2 ranks: every step reports
    the global batch's assistant tokens, as the loader counts them, and a finite loss."""
    import json

    import yaml

    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.data.prepare import prepare
    from tests.chat_models import CONVERSATIONS, save_chat_folder
    from tests.support.runs import torchrun_train, write_spec

    model = save_chat_folder(tmp_path / "model")
    (tmp_path / "src").mkdir()
    records = [{"messages": [{**m, "content": f"{m['content']} ({i})"} for m in c]}
               for i in range(40) for c in CONVERSATIONS]
    (tmp_path / "src" / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    data = tmp_path / "data"
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{model}", output=f"file://{data}", format="chat",
            log=lambda m: None)
    path = write_spec(tmp_path / "spec.yaml", model={**MICRO_MODEL, "vocabSize": 384}, data=f"file://{data}",
                      nproc=2, training={"steps": 3})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["data"].update(format="chat", tokenizer=f"file://{model}")
    path.write_text(yaml.safe_dump(doc))
    got = torchrun_train(path, tmp_path / "out", 2)

    loader = GlobalBatchLoader(open_source(f"file://{data}", seq_len=MICRO_MODEL["seqLen"], vocab_size=384, seed=3,
                                           chat=True), seed=3)
    want = [int((loader.next_batch(4)[1] != -100).sum()) for _ in range(3)]
    assert [r["assistant_tokens"] for r in got] == want
    assert all(0 < n < 4 * MICRO_MODEL["seqLen"] for n in want)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)
