"""Mixtures of experts read from and written to Hugging Face folders (Mixtral, Qwen2-MoE, Qwen3-MoE), each against
transformers itself: a tiny random model made by the family's own config class (tests/hf_models.py) is imported;
kiln's logits equal transformers'; a few AdamW steps on the same batch give transformers' losses including the
load-balancing loss as transformers computes it (`output_router_logits`, `router_aux_loss_coef`); the export
reloads in transformers with the trained weights bit for bit and the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.api.hf import config_for
from kiln.api.load import parse
from kiln.errors import KilnError
from kiln.trainer.model import hf_folder as hf, kernels
from kiln.trainer.model.moe import MoE
from tests.hf_models import MOE_FAMILIES, save_model
from tests.support.families import SEQ, STEPS, batches, exported, imported, step


@pytest.fixture(autouse=True)
def reference_kernels():
    kernels.set_mode("reference")
    yield
    kernels.set_mode("fused")


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_logits_equal_transformers(tmp_path, family):
    reference = save_model(tmp_path / family, family, tokenizer=False)
    model, _ = imported(tmp_path / family)
    moe_layers = [b for b in model.layers.values() if isinstance(b.feed_forward, MoE)]
    assert len(moe_layers) == (1 if family == "qwen2_moe" else 2)  # Qwen2-MoE's layer 1 is dense (mlp_only_layers)
    tokens = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_training_steps_with_the_aux_loss_match_transformers_and_export_reloads(tmp_path, family):
    """The reference loss is transformers' cross-entropy + router_aux_loss_coef x its own aux_loss (what its
    *ForCausalLM adds given labels). Tolerance as for the dense families (test_model_families): fp32 in another
    operation order, three Adam steps of lr 1e-3: 1e-5 relative. The aux loss's share of the loss (coef 0.1 x ~2)
    is 40x that, so a model without it, or with another formula, fails."""
    reference = save_model(tmp_path / "src", family, tokenizer=False).train()
    model, base = imported(tmp_path / "src")
    coef = base["router_aux_loss_coef"]
    assert model.dims.moe.aux_loss_coef == coef and model.dims.moe.z_loss_coef == 0
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ours, theirs, aux = [], [], []
    batch = batches(1)[0]
    for _ in range(STEPS):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = model(inputs, targets)
        out = reference(inputs, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        ref_loss = ce + coef * out.aux_loss
        step((opt, loss), (opt_ref, ref_loss))
        ours.append(loss.item())
        theirs.append(ref_loss.item())
        aux.append(model.router_load.read()["moe_aux_loss"])
        assert aux[-1] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=0)
    assert ours[0] > ours[1] > ours[2]
    assert coef * min(aux) > 40 * 1e-5 * max(ours)  # the aux loss is far above the tolerance

    reloaded = exported(model, base, tmp_path / "out")
    assert type(reloaded) is type(reference)
    theirs_state = reloaded.state_dict()
    ref_state = reference.state_dict()
    for name in ref_state:  # every trained tensor of transformers' model, in its own in-memory layout
        torch.testing.assert_close(theirs_state[name], ref_state[name], rtol=1e-4, atol=1e-5)
    tokens = batches(2)[1]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(tokens).logits, model(tokens), rtol=0, atol=1e-4)


def test_unknown_expert_tensor_and_unsupported_keys_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_model(tmp_path, "mixtral", tokenizer=False)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = state["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    spec = parse({"spec": {"model": {"from": f"file://{tmp_path}", "seqLen": 32}}}).spec
    dims = hf.resolve_dims(spec)
    with pytest.raises(KilnError, match=r"tensor model.layers.0.block_sparse_moe.experts.4.w1.weight is not part of "
                                        r"a mixtral model"):
        hf.Checkpoint(f"file://{tmp_path}").check(dims, tied=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["router_jitter_noise"] = 0.1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KilnError, match=r"config.json: router_jitter_noise = 0.1 is not supported"):
        hf.resolve_dims(spec)
    config["router_jitter_noise"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = parse({"spec": {"model": {"from": f"file://{tmp_path}", "moe": {"experts": 8}}}}).spec
    with pytest.raises(KilnError, match=r"model.moe.experts: the model folder .* sets the experts' shape"):
        hf.resolve_dims(spec)


def test_a_preset_moe_exports_as_mixtral_that_transformers_reloads(tmp_path):
    """tiny-moe (Llama's attention, Mixtral's experts) trained from kiln's own init is written as a Mixtral folder;
    experts transformers has no family for (a sigmoid router) are refused before any checkpoint is read."""
    from transformers import MixtralForCausalLM

    from kiln.api import resolve_model
    from kiln.api.spec import ModelSpec
    from kiln.trainer.model.transformer import build_model

    spec = {"preset": "tiny-moe", "dim": 64, "layers": 2, "heads": 4, "kvHeads": 2, "seqLen": 32,
            "moe": {"experts": 4, "topK": 2, "ffnDim": 32}}
    dims = resolve_model(ModelSpec.model_validate(spec))
    assert dims.arch.family == "mixtral"
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(5)
    reloaded = exported(model, {}, tmp_path)
    assert type(reloaded) is MixtralForCausalLM
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(tokens).logits, model(tokens), rtol=0, atol=1e-4)

    sigmoid = resolve_model(ModelSpec.model_validate({**spec, "moe": {**spec["moe"], "score": "sigmoid"}}))
    assert sigmoid.arch.family == "llama"
    with pytest.raises(ValueError, match=r"model.moe: no transformers family has these experts \(score sigmoid"):
        config_for(sigmoid)
