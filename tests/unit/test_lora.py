"""LoRA (kiln.trainer.model.lora) against peft itself, on a random Llama made by transformers.

peft is the oracle: its `PeftModel.from_pretrained` loads kiln's exported adapter over the same base and gives
kiln's logits; its `merge_and_unload` gives kiln's merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.api.load import parse
from kiln.api.spec import AdapterSpec
from kiln.errors import KilnError
from kiln.storage import open_store
from kiln.trainer.model import hf_export, hf_folder as hf
from kiln.trainer.model.lora import apply_lora, check_base, init_adapters, merge_adapters
from kiln.trainer.model.peft_folder import adapter_record, write_adapter
from kiln.trainer.model.transformer import build_model
from kiln.trainer.optim import build_optimizer
from tests.hf_models import VOCAB, save_model

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "base"
    save_model(path, "gqa", tokenizer=False)
    return path


def lora_spec(folder: Path, **adapter):
    return parse({"spec": {"model": {"from": f"file://{folder}/", "seqLen": 16,
                                     "adapter": {"rank": RANK, "alpha": ALPHA, **adapter}}}}).spec


def kiln_model(spec, *, lora: bool = True) -> torch.nn.Module:
    """The plain model as a run builds it: meta, adapters, allocate, base from the folder, adapters initialised."""
    dims = hf.resolve_dims(spec)
    model = build_model(dims)
    if lora:
        apply_lora(model, spec.model.adapter)
    model.to_empty(device="cpu")
    model.init_buffers()
    hf.load_weights(model, spec.model.from_, dims)
    if lora:
        init_adapters(model, spec.training.seed)
    return model


def batch(seed: int, rows: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def train(model: torch.nn.Module, spec, steps: int = 3) -> torch.optim.Optimizer:
    opt = build_optimizer([model], spec.training.model_copy(update={"lr": 1e-2, "warmup_steps": 0}),
                          torch.device("cpu"))
    for step in range(steps):
        tokens = batch(step)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def peft_model(folder: Path, adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def test_adapters_at_initialisation_leave_the_output_exactly_the_base(folder):
    spec = lora_spec(folder)
    tokens = batch(0)[:, :-1]
    with torch.no_grad():
        assert torch.equal(kiln_model(spec)(tokens), kiln_model(spec, lora=False)(tokens))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_peft_loads_the_trained_adapter_and_gives_kilns_logits(folder, tmp_path, family):
    """Llama, Qwen2 (biased q/k/v projections under the adapters) and Gemma 3 (sandwich norms, tied)."""
    if family != "llama":
        folder = tmp_path / family
        save_model(folder, family, tokenizer=False)
        tmp_path = tmp_path / "adapter"
    spec = lora_spec(folder)
    model = kiln_model(spec)
    train(model, spec)
    b = dict(model.named_parameters())["layers.1.feed_forward.w2.lora_B.weight"]
    assert b.abs().max() > 1e-3  # trained away from zero: the comparison below tests the update, not only the base
    files = write_adapter(open_store(f"file://{tmp_path}/"), model, spec.model.adapter, spec.model.from_)
    assert files == ["adapter_model.safetensors", "adapter_config.json"]
    ref = peft_model(folder, tmp_path)
    tokens = batch(7)[:, :-1]
    with torch.no_grad():
        ours, theirs = model(tokens), ref(input_ids=tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    # every adapter kiln trained is one peft loaded (none left at peft's own initialisation)
    loaded = {n for n, _ in ref.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 2 * 7  # A and B, 2 blocks, 7 projections


def test_merged_weights_equal_peft_merge_and_unload_and_base_plus_scaled_ba(folder, tmp_path):
    spec = lora_spec(folder, targets=["q_proj", "down_proj"])
    model = kiln_model(spec)
    train(model, spec, steps=2)
    write_adapter(open_store(f"file://{tmp_path}/"), model, spec.model.adapter, spec.model.from_)
    params = dict(model.named_parameters())
    w, a, b = (params[f"layers.0.attention.wq.{k}"].detach().clone() for k in ("weight", "lora_A.weight", "lora_B.weight"))
    merged = hf_export.hf_state(merge_adapters(model), torch.float32)
    theirs = peft_model(folder, tmp_path).merge_and_unload().state_dict()
    assert set(merged) <= set(theirs) and not any("lora" in n for n in merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], w + (ALPHA / RANK) * b @ a,
                               rtol=0, atol=1e-6)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], w)  # the update is in it


def test_only_adapters_train_and_the_optimizer_holds_their_state_only(folder):
    spec = lora_spec(folder)
    dims = hf.resolve_dims(spec)
    model = kiln_model(spec)
    hd, d, f = dims.head_dim, dims.dim, dims.ffn_dim
    # (in, out) of the seven projections of a block
    shapes = [(d, dims.heads * hd), (d, dims.kv_heads * hd), (d, dims.kv_heads * hd), (dims.heads * hd, d),
              (d, f), (d, f), (f, d)]
    adapter_numel = dims.layers * sum(RANK * (i + o) for i, o in shapes)
    assert adapter_numel == 4096  # 2 blocks x 4 x (64 + 48 + 48 + 64 + 96 + 96 + 96)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable) and len(trainable) == 2 * 7 * dims.layers
    assert sum(p.numel() for p in trainable.values()) == adapter_numel
    opt = train(model, spec, steps=1)
    assert all(p.grad is None for p in model.parameters())  # zeroed; frozen ones never had any
    state = [opt.state[p] for p in trainable.values()]
    assert len(opt.state) == len(trainable)
    moments = sum(s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq"))
    assert moments == 2 * 4 * adapter_numel  # fp32 Adam moments of the adapters, nothing else
    assert all(s["exp_avg"].dtype == torch.float32 for s in state)


def test_frozen_base_is_kept_in_the_runs_precision_and_adapters_in_fp32(folder):
    spec = lora_spec(folder)
    model = apply_lora(build_model(hf.resolve_dims(spec)), spec.model.adapter, torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}


def test_a_target_that_names_no_module_is_one_line_naming_the_field(folder):
    with pytest.raises(KilnError) as err:
        parse({"spec": {"model": {"preset": "tiny", "adapter": {"targets": ["q_proj", "qkv_proj"]}}}})
    assert "spec.model.adapter.targets.1" in str(err.value) and "qkv_proj" in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    spec = lora_spec(folder)
    bad = AdapterSpec.model_construct(type="lora", rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "qkv_proj"])
    with pytest.raises(KilnError, match=r"^spec\.model\.adapter\.targets: 'qkv_proj' names no module of this model "
                                        r"\(its projections: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
                                        r"v_proj\)$"):
        apply_lora(build_model(hf.resolve_dims(spec)), bad)
    with pytest.raises(KilnError, match="spec.model.adapter.rank"):
        parse({"spec": {"model": {"preset": "tiny", "adapter": {"rank": 0}}}})


def test_defaults_target_every_projection_at_rank_16():
    a = parse({"spec": {"model": {"preset": "tiny", "adapter": {}}}}).spec.model.adapter
    assert (a.type, a.rank, a.alpha, a.dropout) == ("lora", 16, 32.0, 0.0)
    assert a.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_base_identity_names_the_folder_and_changes_with_its_weights_index(folder, tmp_path):
    spec = lora_spec(folder)
    dims = hf.resolve_dims(spec)
    mine = adapter_record(spec, dims)
    assert mine["base"]["uri"] == f"file://{folder}/" and mine == adapter_record(spec, dims)
    other = tmp_path / "other"
    save_model(other, "tied", tokenizer=False)  # same dims, another index (no lm_head)
    theirs = adapter_record(lora_spec(other), dims)
    assert theirs["base"]["digest"] != mine["base"]["digest"]
    why = check_base(mine, theirs, "file:///ck/step-00000003")
    assert why is not None and len(why.splitlines()) == 1
    assert mine["base"]["uri"] in why and theirs["base"]["uri"] in why and mine["base"]["digest"] in why
    assert check_base(mine, dict(mine), "x") is None
    assert "full fine-tune" in check_base(None, mine, "x") and "only LoRA adapters" in check_base(mine, None, "x")
    assert json.loads(json.dumps(mine)) == mine  # it goes into trainer.json


def trained_against_peft(tmp_path, folder, spec, frozen):
    """3 AdamW steps of kiln's adapted model (the router losses in the loss), the parameters whose name `frozen`
    takes checked frozen and unchanged, then the export loaded by peft over transformers' base: (model, kiln's
    logits, peft's logits, kiln's trainable names, peft's adapter names)."""
    model = kiln_model(spec)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if frozen(n)}
    assert before and not any(p.requires_grad for n, p in model.named_parameters() if n in before)
    train(model, spec)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n
    assert max(float(p.detach().abs().max()) for n, p in model.named_parameters() if ".lora_B." in n) > 1e-3
    out = tmp_path / "adapter"
    write_adapter(open_store(f"file://{out}/"), model, spec.model.adapter, spec.model.from_)
    ref = peft_model(folder, out)
    tokens = batch(7)[:, :-1]
    with torch.no_grad():
        ours, theirs = model(tokens), ref(input_ids=tokens).logits
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return model, ours, theirs, trained, {n for n, _ in ref.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("family,targets", [
    ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"]),  # every layer sparse: the attention only
    ("qwen2_moe", None),  # the defaults: attention, the shared expert's and the dense layer's MLP
])
def test_lora_on_a_mixture_of_experts_trains_adapters_only_and_peft_gives_kilns_logits(tmp_path, family, targets):
    """A Mixtral and a Qwen2-MoE made by transformers: after 3 AdamW steps (the router losses in the loss) the router
    and the routed experts are unchanged, and peft's load of the exported adapter over transformers' base gives
    kiln's logits within 1e-4 (fp32), every adapter kiln trained among the ones peft loaded."""
    folder = tmp_path / family
    save_model(folder, family, tokenizer=False)
    if family == "mixtral":  # the defaults name an MLP that no layer has: refused in one line, before any memory
        with pytest.raises(KilnError, match=r"^spec\.model\.adapter\.targets: 'down_proj' names no module of "
                                            r"this model \(its projections: experts\.down_proj, "
                                            r"experts\.gate_up_proj, k_proj, o_proj, q_proj, v_proj\)$"):
            apply_lora(build_model(hf.resolve_dims(lora_spec(folder))), lora_spec(folder).model.adapter)
    spec = lora_spec(folder, **({"targets": targets} if targets else {}))
    model, ours, theirs, trained, loaded = trained_against_peft(
        tmp_path, folder, spec, lambda n: ".router." in n or ".experts." in n)
    assert (ours - theirs).abs().max() < 1e-4
    # 2 layers x 4 attention projections; Qwen2-MoE adds layer 0's shared expert and layer 1's dense MLP (3 each)
    assert len(loaded) == len(trained) == 2 * (8 + (6 if family == "qwen2_moe" else 0))
    if family == "qwen2_moe":
        assert any(".mlp.shared_expert.gate_proj.lora_A" in n for n in loaded)


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.mark.parametrize("family,targets", [
    ("mixtral", ["q_proj", *EXPERTS]),
    ("qwen2_moe", ["v_proj", "gate_proj", "experts.down_proj"]),  # one expert target alone: peft wraps it alone
])
def test_lora_on_the_routed_experts_equals_peft_target_parameters(tmp_path, family, targets):
    """LoRA on the routed experts (one adapter per expert) against peft's `target_parameters` on transformers' own
    stacked expert parameters: after 3 AdamW steps, peft's load of the export gives kiln's logits within 1e-4 with
    exactly kiln's adapters (a B laid out in the wrong order, or the gate and up halves swapped, moves them far
    more); the experts' base weights are unchanged; kiln's merge gives the adapted model's logits."""
    folder = tmp_path / family
    save_model(folder, family, tokenizer=False)
    spec = lora_spec(folder, targets=targets)
    model, ours, theirs, trained, loaded = trained_against_peft(
        tmp_path, folder, spec, lambda n: n.endswith((".w1", ".w2", ".w3")))
    experts_b = [p for n, p in model.named_parameters() if ".experts." in n and ".lora_B." in n]
    assert experts_b and min(float(p.detach().abs().max()) for p in experts_b) > 1e-3  # the experts' updates trained
    assert (ours - theirs).abs().max() < 1e-4
    assert len(loaded) == len(trained)
    with torch.no_grad():
        merged = merge_adapters(model)(batch(7)[:, :-1])
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert (merged - ours).abs().max() < 1e-4


def test_expert_targets_refuse_dropout_and_a_dense_model(folder):
    dims = hf.resolve_dims(lora_spec(folder))
    with pytest.raises(KilnError, match=r"^spec\.model\.adapter\.targets: 'experts\.down_proj' names no module"):
        apply_lora(build_model(dims), lora_spec(folder, targets=["q_proj", "experts.down_proj"]).model.adapter)
    moe = parse({"spec": {"model": {"preset": "tiny-moe", "adapter": {"targets": EXPERTS, "dropout": 0.1}}}}).spec
    with pytest.raises(KilnError, match=r"^spec\.model\.adapter\.dropout: got 0\.1 with targets"):
        apply_lora(build_model(hf.resolve_dims(moe)), moe.model.adapter)


def test_a_pipeline_stage_takes_the_whole_models_targets_and_one_without_any_is_refused(tmp_path):
    """Qwen2-MoE (layer 0 routed, layer 1 dense) split in 2 stages: stage 1 has no experts, yet expert targets
    with q_proj adapt it (checked against the whole model); the expert targets alone leave it nothing to train,
    refused in one line naming the field (every rank computes every stage's targets: all refuse alike)."""
    from kiln.trainer.model.lora import offered_targets
    from kiln.trainer.parallel.parallelize import check_stages_train, split_for_stage, stage_layers

    save_model(tmp_path, "qwen2_moe", tokenizer=False)
    spec = lora_spec(tmp_path, targets=["q_proj", *EXPERTS])
    whole = build_model(hf.resolve_dims(spec))
    stages = [offered_targets(whole, stage_layers(2, 2, s)) for s in range(2)]
    assert set(EXPERTS) <= stages[0] and not set(EXPERTS) & stages[1]
    assert stages[0] | stages[1] == offered_targets(whole)
    stage = apply_lora(split_for_stage(whole, 2, 1), spec.model.adapter, offered=stages[0] | stages[1])
    assert sorted(n for n, p in stage.named_parameters() if p.requires_grad) == [
        "layers.1.attention.wq.lora_A.weight", "layers.1.attention.wq.lora_B.weight"]
    check_stages_train(spec.model.adapter.targets, stages, 2)
    with pytest.raises(KilnError, match=r"^spec\.model\.adapter\.targets: experts\.down_proj name no module of "
                                        r"pipeline stage 1 of 2 \(spec\.parallelism\.pipeline; its layers 1 to 1 "
                                        r"have down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\); "
                                        r"every stage must train an adapter: add a target its layers have$"):
        check_stages_train(["experts.down_proj"], stages, 2)
