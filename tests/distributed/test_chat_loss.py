"""data.format chat's loss: the mean over the assistant tokens of the whole global batch, whatever the layout.

Two real gloo ranks run the trainer's own step functions (kiln.trainer.run `accumulate_step`,
kiln.trainer.parallel.microbatches `pipeline_step`, with kiln.trainer.model.loss) on one global batch whose assistant tokens are spread
very unevenly over ranks and microbatches (one microbatch has none). Their gradients, gathered by parameter name,
must equal those of the single-process reference: sum of the assistant tokens' cross-entropy / their count, over
the full batch. The mean of per-microbatch means, which equal-weighting would give, differs from it by far more
than the tolerance (checked too, so the comparison can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.ranks import run_ranks
from tests.distributed.trainer_helpers import MICRO_MODEL

pytestmark = [pytest.mark.distributed]

LAYOUTS = {"dp2-fsdp-accum2": {"fsdp": True}, "tp2": {"tensor": 2}, "pp2": {"pipeline": 2}}
GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 2, 3


def spec(parallelism: dict):
    from kiln.api import TrainingSpec

    return TrainingSpec.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "c"},
        "spec": {"model": MICRO_MODEL, "training": {"globalBatchSize": GLOBAL_BATCH, "microBatchSize": MICRO_BATCH,
                                                    "precision": "fp32", "seed": SEED},
                 "parallelism": {"compile": False, **parallelism}, "resources": {"processesPerNode": 2}},
    }).spec


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


def layout_grads(rank: int, world: int, out: str) -> dict:
    from torch.distributed.tensor import DTensor

    from kiln.trainer.model import hf_folder as hf, kernels
    from kiln.trainer.model.loss import PipelineLoss, global_count, global_loss
    from kiln.trainer.model.transformer import build_model, cross_entropy
    from kiln.trainer.parallel.parallelize import build_mesh, build_pipeline_schedule, dp_coordinates, parallelize, plan_layout
    from kiln.trainer.parallel.microbatches import pipeline_step
    from kiln.trainer.run import accumulate_step

    losses = {}
    for name, parallelism in LAYOUTS.items():
        s = spec(parallelism)
        dims = hf.resolve_dims(s)
        layout = plan_layout(s, dims, world)
        kernels.set_mode(s.parallelism.kernels)
        mesh = build_mesh(layout, "cpu")
        model = parallelize(build_model(dims), mesh, layout, s)
        model.to_empty(device="cpu")
        model.init_weights(SEED)
        inputs, targets = batch(dims.vocab_size, dims.seq_len)
        dp_rank, dp_size = dp_coordinates(mesh)
        rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
        inputs, targets = inputs[rows], targets[rows]
        denominator = global_count(targets, layout)
        pp_rank = mesh["pp"].get_local_rank()
        is_first, is_last = pp_rank == 0, pp_rank == layout.pp - 1
        if layout.pp > 1:
            pp_loss = PipelineLoss(cross_entropy, layout)
            pp_loss.denominator = denominator
            schedule = build_pipeline_schedule(model, mesh, layout, torch.device("cpu"), pp_loss)
            local = pipeline_step(schedule, inputs, targets, is_first, is_last)
        else:
            local = accumulate_step(model, inputs, targets, layout, denominator)
        losses[name] = global_loss(local if is_last and mesh["tp"].get_local_rank() == 0 else None, layout,
                                   torch.device("cpu"))
        grads = {}
        for pname, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[pname] = g.detach().clone()
        torch.save(grads, f"{out}/{name}-{rank}.pt")
        assert layout.grad_accum * layout.dp * MICRO_BATCH == GLOBAL_BATCH
    return losses


def reference(*, per_microbatch_mean: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the full batch: sum of assistant-token losses / their count (or, to show the difference,
    the mean of the means of the four microbatches of 2 rows)."""
    from kiln.trainer.model import hf_folder as hf
    from kiln.trainer.model.transformer import build_model

    s = spec({})
    dims = hf.resolve_dims(s)
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
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
    losses = run_ranks(layout_grads, 2, tmp_path, str(tmp_path), start="spawn")
    want_loss, want = reference()
    _, equal_weighting = reference(per_microbatch_mean=True)
    tol = dict(rtol=1e-4, atol=1e-6)
    gap = max((equal_weighting[n] - want[n]).abs().max().item() for n in want)
    assert gap > 100 * tol["atol"], "the batch must tell the global mean from a mean of microbatch means"
    for name in LAYOUTS:
        assert losses[0][name] == losses[1][name] == pytest.approx(want_loss, rel=1e-5), name
        got = {}
        for rank in range(2):  # a pipeline stage holds only its own layers: the union covers the model
            got.update(torch.load(tmp_path / f"{name}-{rank}.pt"))
        assert got.keys() == want.keys(), name
        for pname, g in want.items():
            torch.testing.assert_close(got[pname], g, **tol, msg=lambda m: f"{name} {pname}: {m}")


def test_kiln_train_takes_the_loss_on_the_prepared_assistant_tokens(tmp_path):
    """`kiln data prepare --format chat`, then `kiln train` with data.format chat on 2 ranks: every step reports
    the global batch's assistant tokens, as the loader counts them, and a finite loss."""
    import json

    import yaml

    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.data.prepare import prepare
    from tests.chat_models import CONVERSATIONS, save_chat_folder
    from tests.distributed.trainer_helpers import torchrun_train, write_spec

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
