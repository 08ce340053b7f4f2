"""The loss-normalisation tests' worker (chat masks, packed rows): one global batch through the trainer's own step
functions (kiln.trainer.parallel.microbatches `accumulate_step` and `pipeline_step`,
kiln.trainer.model.loss) in each of LAYOUTS on two real gloo ranks, each rank saving the full gradients it holds by
parameter name; and the check that every layout gave the single-process reference's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.support.runs import MICRO_MODEL

LAYOUTS = {"dp2-fsdp-accum2": {"fsdp": True}, "tp2": {"tensor": 2}, "pp2": {"pipeline": 2}}


def random_batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 random sequences (the same every time): the mixture-of-experts layout tests' global batch."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (8, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def layout_spec(parallelism: dict, global_batch: int, micro_batch: int, seed: int, model: dict = MICRO_MODEL,
                world: int = 2):
    from kiln.api import TrainingSpec

    return TrainingSpec.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "l"},
        "spec": {"model": model, "training": {"globalBatchSize": global_batch, "microBatchSize": micro_batch,
                                              "precision": "fp32", "seed": seed},
                 "parallelism": {"compile": False, **parallelism}, "resources": {"processesPerNode": world}},
    }).spec


def reference_model(global_batch: int, micro_batch: int, seed: int):
    """The single-process model of the same dims and weights, and its dims."""
    from kiln.trainer.model import hf_folder as hf
    from kiln.trainer.model.transformer import build_model

    dims = hf.resolve_dims(layout_spec({}, global_batch, micro_batch, seed))
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model, dims


def layout_grads(rank: int, world: int, out: str, make_batch, global_batch: int, micro_batch: int,
                 seed: int, layouts: dict = LAYOUTS, model_spec: dict = MICRO_MODEL) -> dict:
    """Each of `layouts`' global loss; gradients to out/<layout>-<rank>.pt. `make_batch(vocab, seq)`: the global
    batch, (inputs, targets) or with packed rows (inputs, targets, doc_ids)."""
    from torch.distributed.tensor import DTensor

    from kiln.trainer.model import hf_folder as hf, kernels
    from kiln.trainer.model.loss import PipelineLoss, global_count, global_loss
    from kiln.trainer.model.transformer import build_model, cross_entropy
    from kiln.trainer.parallel.microbatches import pipeline_step
    from kiln.trainer.parallel.parallelize import (build_mesh, build_pipeline_schedule, dp_coordinates, parallelize,
                                                   plan_layout)
    from kiln.trainer.parallel.microbatches import accumulate_step

    losses = {}
    for name, parallelism in layouts.items():
        s = layout_spec(parallelism, global_batch, micro_batch, seed, model_spec, world)
        dims = hf.resolve_dims(s)
        layout = plan_layout(s, dims, world)
        assert layout.grad_accum * layout.dp * micro_batch == global_batch
        kernels.set_mode(s.parallelism.kernels)
        mesh = build_mesh(layout, "cpu")
        model = parallelize(build_model(dims), mesh, layout, s)
        model.to_empty(device="cpu")
        model.init_weights(seed)
        dp_rank, dp_size = dp_coordinates(mesh)
        rows = slice(dp_rank * global_batch // dp_size, (dp_rank + 1) * global_batch // dp_size)
        inputs, targets, *doc_ids = (t[rows] for t in make_batch(dims.vocab_size, dims.seq_len))
        doc_ids = doc_ids[0] if doc_ids else None
        denominator = global_count(targets, layout)
        pp_rank = mesh["pp"].get_local_rank()
        is_first, is_last = pp_rank == 0, pp_rank == layout.pp - 1
        if layout.pp > 1:
            pp_loss = PipelineLoss(cross_entropy, layout)
            pp_loss.denominator = denominator
            schedule = build_pipeline_schedule(model, mesh, layout, torch.device("cpu"), pp_loss)
            local = pipeline_step(schedule, inputs, targets, is_first, is_last, doc_ids=doc_ids)
        else:
            local = accumulate_step(model, inputs, targets, layout, denominator, doc_ids)
        losses[name] = global_loss(local if is_last and mesh["tp"].get_local_rank() == 0 else None, layout,
                                   torch.device("cpu"))
        grads = {pname: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                 for pname, p in model.named_parameters()}
        torch.save(grads, f"{out}/{name}-{rank}.pt")
    return losses


def assert_layouts_match(losses: list[dict], out, want_loss: float, want: dict[str, torch.Tensor]) -> None:
    """Both ranks report the reference's loss in every layout, and their gradients together are its gradients."""
    for name in LAYOUTS:
        assert losses[0][name] == losses[1][name] == pytest.approx(want_loss, rel=1e-5), name
        got = {}
        for rank in range(2):  # a pipeline stage holds only its own layers: the union covers the model
            got.update(torch.load(out / f"{name}-{rank}.pt"))
        assert got.keys() == want.keys(), name
        for pname, g in want.items():
            torch.testing.assert_close(got[pname], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")
