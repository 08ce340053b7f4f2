"""The model: shapes, causality, parameter count, name-seeded init, pipeline split, AC and the fused loss."""

from __future__ import annotations

import copy

import pytest
import torch
from kiln.api import ModelDims, resolve_model
from kiln.api.spec import ModelSpec
from kiln.trainer.parallel import parallelize as parallel
from kiln.trainer.model.transformer import build_model, count_params, cross_entropy

DIMS = ModelDims(dim=32, layers=3, heads=4, kv_heads=2, vocab_size=64, seq_len=16, ffn_dim=48)


def materialised(dims=DIMS, seed=0):
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def tokens(batch=2, seq=16, vocab=64, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_meta_build_allocates_nothing_and_counts_parameters():
    model = build_model(DIMS)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_params(DIMS)
    assert count_params(DIMS) - count_params(DIMS, embedding=False) == 64 * 32


def test_llama_1b_preset_has_the_published_size():
    n = count_params(resolve_model(ModelSpec(preset="llama-1b")))
    assert 1.4e9 < n < 1.6e9  # Llama 3.2 1B: 1.24B with tied embeddings, +0.26B untied output


def test_logits_shape_and_scalar_loss():
    model, x = materialised(), tokens()
    logits = model(x)
    assert logits.shape == (2, 16, 64)
    loss = model(x, x)
    assert loss.shape == () and torch.isfinite(loss)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.05)  # near-uniform at init


def test_fused_loss_equals_loss_from_logits():
    model, x, y = materialised(), tokens(seed=1), tokens(seed=2)
    fused = model(x, y)
    model.fused_loss = False
    assert model(x, y).item() == pytest.approx(fused.item(), rel=1e-5)
    assert cross_entropy(model(x), y).item() == pytest.approx(fused.item(), rel=1e-5)


def test_attention_is_causal():
    model, x = materialised(), tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 64
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_init_depends_only_on_seed_and_parameter_name():
    a, b, c = materialised(seed=1), materialised(seed=1), materialised(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # A deeper model shares the names, and so the values, of the layers both have (except the scaled outputs).
    deeper = materialised(ModelDims(**{**DIMS.model_dump(), "layers": 4}), seed=1)
    assert torch.equal(deeper.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)


@pytest.mark.parametrize("pp,stage,kept", [(2, 0, ["0"]), (2, 1, ["1", "2"]), (3, 1, ["1"])])
def test_pipeline_stage_keeps_its_blocks_under_the_same_names(pp, stage, kept):
    full = materialised()
    part = parallel.split_for_stage(copy.deepcopy(full), pp, stage)
    assert list(part.layers.keys()) == kept
    full_params = dict(full.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full_params[name]), name
    assert (part.tok_embeddings is not None) == (stage == 0)
    assert (part.output is not None) == (stage == pp - 1)


def test_pipeline_stages_chained_equal_the_whole_model():
    full, x = materialised(), tokens()
    stages = [parallel.split_for_stage(copy.deepcopy(full), 2, s) for s in range(2)]
    assert torch.allclose(stages[1](stages[0](x)), full(x), atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_names_and_gradients(mode):
    ref, ac = materialised(), materialised()
    parallel.apply_activation_checkpointing(ac, mode)
    assert [n for n, _ in ac.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = tokens()
    ref(x, x).backward()
    ac(x, x).backward()
    for (name, a), b in zip(ref.named_parameters(), ac.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_a_compiled_mixture_of_experts_compiles_once_not_each_forward():
    # the router's bookkeeping (moe.RouterLoad: a forwards counter, the loads) changes each forward; traced, it
    # was a constant of the graph, recompiled every microbatch until dynamo's limit (8), then run uncompiled
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kiln.api.presets import MoEDims

    model = materialised(DIMS.model_copy(update={"moe": MoEDims(experts=4, top_k=2, ffn_dim=16, aux_loss_coef=0.01,
                                                                 z_loss_coef=0.001)}))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing and guards only: no inductor, fast
    x = tokens()
    compiled_after = []
    for _ in range(12):  # one step's microbatches: the load is read (and reset) once per step, not here
        compiled(x, x).backward()
        compiled_after.append(counters["frames"]["ok"])
    assert compiled_after[3] == compiled_after[-1], compiled_after
    assert model.router_load.read()["moe_busiest_tokens"] > 0  # the bookkeeping still ran, outside the graph
    torch._dynamo.reset()
