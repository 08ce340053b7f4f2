"""Gradient clipping as the training step runs it: folded into the fused AdamW's step over plain tensors (one pass
over the gradients fewer), clipped in place over DTensors; the same updates either way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kiln.trainer.optim import clip_grad_norm_


def params_and_optimizer(dtensor_mesh=None):
    """Two parameters (a matrix with weight decay, a vector without, as build_optimizer groups them) and fused AdamW."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    if dtensor_mesh is not None:
        from torch.distributed.tensor import Replicate, distribute_tensor

        tensors = [distribute_tensor(t, dtensor_mesh, [Replicate()]) for t in tensors]
    params = [torch.nn.Parameter(t) for t in tensors]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)


def train(params, opt, max_norm: float, *, fold: bool, scales=(30.0, 0.01, 30.0, 0.01)) -> list[float]:
    """Steps with gradients of large and small norm (clipped and not); returns the norms clip reported."""
    gen = torch.Generator().manual_seed(1)
    norms = []
    for scale in scales:
        for p in params:
            g = torch.randn(p.shape, generator=gen) * scale
            p.grad = g if type(p.data) is torch.Tensor else type(p.data).from_local(g, p.device_mesh, p.placements)
        norms.append(float(clip_grad_norm_(params, max_norm, optimizer=opt if fold else None)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def local(p: torch.Tensor) -> torch.Tensor:
    return p.detach().to_local() if hasattr(p, "to_local") else p.detach()


@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clipping", "measuring-only"])
def test_folding_the_clip_into_fused_adamw_updates_as_clipping_in_place(max_norm):
    inplace_params, inplace_opt = params_and_optimizer()
    folded_params, folded_opt = params_and_optimizer()
    inplace_norms = train(inplace_params, inplace_opt, max_norm, fold=False)
    folded_norms = train(folded_params, folded_opt, max_norm, fold=True)
    assert folded_norms == inplace_norms
    assert max(folded_norms) > 10 * max(max_norm, 1) > min(folded_norms)  # steps with and without clipping
    for a, b in zip(inplace_params, folded_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(params_and_optimizer()[0], folded_params))  # it moved


def test_the_folded_clip_is_the_optimizers_and_a_step_without_clipping_leaves_none():
    params, opt = params_and_optimizer()
    for p in params:
        p.grad = torch.full(p.shape, 3.0)
    norm = clip_grad_norm_(params, 1.0, optimizer=opt)
    assert all(torch.equal(p.grad, torch.full(p.shape, 3.0)) for p in params)  # not scaled here...
    assert float(opt.grad_scale) == pytest.approx(float(norm), rel=1e-6)  # ...but by the step: grad / (norm / 1.0)
    clip_grad_norm_(params, 0.0, optimizer=opt)  # a run with gradClip 0 after one with clipping
    assert opt.grad_scale is None


def test_dtensor_gradients_are_clipped_in_place_with_the_same_updates():
    """FSDP and TP grads are DTensors: the fused step over them takes no plain scale tensor, so clip scales them
    itself even when handed the optimizer, and the updates match the plain tensors' folded ones."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        d_params, d_opt = params_and_optimizer(mesh)
        for p in d_params:
            p.grad = type(p.data).from_local(torch.full(p.shape, 3.0), mesh, p.placements)
        clip_grad_norm_(d_params, 1.0, optimizer=d_opt)
        assert getattr(d_opt, "grad_scale", None) is None
        assert all(local(p.grad).abs().max() < 3.0 for p in d_params)  # scaled in place
        d_opt.zero_grad(set_to_none=True)

        d_params, d_opt = params_and_optimizer(mesh)
        plain_params, plain_opt = params_and_optimizer()
        assert train(d_params, d_opt, 1.0, fold=True) == pytest.approx(train(plain_params, plain_opt, 1.0, fold=True))
        for a, b in zip(plain_params, d_params):
            torch.testing.assert_close(local(b), a.detach(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
