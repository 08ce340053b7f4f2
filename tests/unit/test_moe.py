"""The MoE block (kiln.trainer.model.moe): routing loses and duplicates no token, grouped GEMMs equal the loop."""

import pytest
import torch
import torch.nn.functional as F

from kiln.trainer.model import moe


def _block(score="softmax", norm_topk=True, shared=0, E=8, k=2, dim=32, hidden=48, seed=0):
    torch.manual_seed(seed)
    m = moe.MoE(dim, E, hidden, k, score=score, norm_topk=norm_topk, shared_hidden=shared, shared_gate=bool(shared))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def _dense_reference(m: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked by the routing: a (T, E) gate that is the top-k weight where the
    token chose the expert and 0 elsewhere. No sorting, no dispatch: what dispatch/combine must equal."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, chosen = m.router(flat)
    gate = torch.zeros(flat.shape[0], m.num_experts).scatter(1, chosen, weights)
    ex = m.experts
    every = torch.stack([F.linear(F.silu(F.linear(flat, ex.w1[e])) * F.linear(flat, ex.w3[e]), ex.w2[e])
                         for e in range(m.num_experts)], 1)  # (T, E, dim)
    out = (every * gate.unsqueeze(-1)).sum(1)
    if m.shared_experts is not None:
        out = out + torch.sigmoid(m.shared_gate(flat)) * m.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("score,norm_topk,shared", [("softmax", True, 0), ("softmax", False, 24), ("sigmoid", True, 0)])
@pytest.mark.parametrize("grouped", [True, False])
def test_dispatch_combine_equals_the_dense_reference(score, norm_topk, shared, grouped):
    m = _block(score, norm_topk, shared)
    m.experts.grouped = grouped
    x = torch.randn(3, 20, 32)
    torch.testing.assert_close(m(x), _dense_reference(m, x), atol=1e-5, rtol=1e-5)
    assert int(m.stats.tokens.sum()) == 3 * 20 * 2  # every token counted k times, none dropped


def test_a_lost_or_duplicated_row_is_caught():
    """The reference is sensitive: combining with one row's result dropped (or counted twice) differs."""
    m = _block()
    x = torch.randn(2, 10, 32)
    good = m(x)

    class Lossy(torch.nn.Module):
        def forward(self, rows, counts):
            out = m.experts(rows, counts).clone()
            out[0] = 0  # one routed row lost
            return out

    flat = x.reshape(-1, 32)
    _, w, c = m.router(flat)
    assert not torch.allclose(moe.combine(Lossy(), flat, w, c, 8).view_as(x), _dense_reference(m, x), atol=1e-4)
    torch.testing.assert_close(good, _dense_reference(m, x), atol=1e-5, rtol=1e-5)


def test_grouped_and_loop_agree_forward_and_backward_with_empty_experts():
    E, dim, hidden = 6, 16, 32
    ex = moe.GroupedExperts(E, dim, hidden)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.tensor([3, 0, 5, 0, 0, 4])  # experts with no rows: empty groups
    x = torch.randn(int(counts.sum()), dim)
    grads, outs = [], []
    for grouped in (True, False):
        ex.grouped = grouped
        ex.zero_grad()
        xi = x.clone().requires_grad_()
        y = ex(xi, counts)
        y.backward(torch.ones_like(y) * torch.arange(y.shape[0])[:, None])
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad.clone() for p in ex.parameters()])
    assert moe.grouped_mm_runs(torch.device("cpu"), torch.float32, dim, hidden)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert float(grads[0][1][1].abs().sum()) == 0  # an expert that got no row gets no gradient


def test_describe_names_the_path():
    assert "grouped GEMMs" in moe.describe(torch.device("cpu"), torch.float32, 32, 48)
    assert "16 bytes" in moe.describe(torch.device("cpu"), torch.float32, 30, 48)


def test_moe_dims_from_preset_and_spec_name_the_missing_field():
    from kiln.api import resolve_model
    from kiln.api.spec import ModelSpec

    dims = resolve_model(ModelSpec.model_validate({"preset": "tiny-moe", "moe": {"auxLossCoef": 0.1}}))
    assert (dims.moe.experts, dims.moe.top_k, dims.moe.aux_loss_coef, dims.moe.z_loss_coef) == (8, 2, 0.1, 0.001)
    assert resolve_model(ModelSpec(preset="tiny")).moe is None
    with pytest.raises(ValueError, match=r"^model.moe: set experts, ffnDim \(no preset or model folder gives them\)$"):
        resolve_model(ModelSpec.model_validate({"preset": "tiny", "moe": {"topK": 2}}))
    with pytest.raises(ValueError, match=r"model.moe.topK 9 exceeds model.moe.experts 8"):
        resolve_model(ModelSpec.model_validate({"preset": "tiny-moe", "moe": {"topK": 9}}))
