"""The fused kernels inside a real training step on CPU ranks, under Triton's interpreter.

`step_case` runs in each rank of a gloo group whose processes have TRITON_INTERPRET=1 from birth (kiln's
switch then routes plain CPU tensors to the Triton kernels, as it routes plain CUDA tensors on a GPU): kiln's
model, parallelized by kiln (FSDP2 over 2 ranks, or tensor parallel 2 with sequence parallel), takes one
forward and backward with the reference kernels and one with the fused ones, from the same weights and batch.
It returns both losses, the largest gradient difference relative to the gradient's scale, and which
implementation each kernel call took with which argument types (tests.distributed.observed_train).
"""

from __future__ import annotations

import torch

SEED = 7
MODEL = {"preset": "tiny", "dim": 64, "layers": 1, "heads": 4, "kvHeads": 2, "seqLen": 16, "ffnDim": 128}


def _spec(parallelism: dict, world: int):
    from kiln.api.load import parse

    return parse({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "k"}, "spec": {
        "model": MODEL, "training": {"steps": 1, "globalBatchSize": 2 * world, "microBatchSize": 2,
                                     "precision": "fp32"},
        "parallelism": {"compile": False, **parallelism}, "resources": {"processesPerNode": world}}}).spec


def _grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def step_case(rank: int, world: int, layouts: dict[str, dict]) -> dict:
    """{layout name: its result} for each of `layouts` ({name: spec.parallelism}), in one process group."""
    return {name: _step(world, parallelism) for name, parallelism in layouts.items()}


def _step(world: int, parallelism: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kiln.trainer.model import kernels
    from kiln.trainer.model.hf_folder import resolve_dims
    from kiln.trainer.model.transformer import build_model
    from kiln.trainer.parallel.parallelize import build_mesh, parallelize, plan_layout
    from tests.distributed import observed_train

    assert kernels._TRITON_OPS is not None, kernels._NO_TRITON_WHY
    if not observed_train.kernels_counted:
        observed_train.count_kernels()
    spec = _spec(parallelism, world)
    dims = resolve_dims(spec)
    layout = plan_layout(spec, dims, world)
    mesh = build_mesh(layout, "cpu")
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, dims.vocab_size, (2 * world, dims.seq_len + 1), generator=g)
    if layout.dp > 1:  # each data-parallel rank its own half of the batch, as the loader gives it
        tokens = tokens.chunk(layout.dp)[mesh["dp_shard"].get_local_rank()]
    out = {}
    for mode in ("reference", "fused"):
        kernels.set_mode(mode)
        observed_train.kernels.clear()
        model = parallelize(build_model(dims), mesh, layout, spec)
        model.to_empty(device="cpu")
        model.init_weights(SEED)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        total = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(total)
        out[mode] = {"loss": total.item() / world, "grads": _grads(model), "kernels": dict(observed_train.kernels)}
    kernels.set_mode("fused")
    ref, fused = out["reference"]["grads"], out["fused"]["grads"]
    assert ref.keys() == fused.keys()
    grad_error = max(((fused[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item() for n in ref)
    return {"loss": {m: out[m]["loss"] for m in out}, "grad_error": grad_error,
            "kernels": {m: out[m]["kernels"] for m in out}}
