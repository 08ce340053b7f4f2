"""The model families kiln reads from Hugging Face folders (Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3), each
against transformers itself: a tiny random model made by the family's own config class and saved with
`save_pretrained` (tests/hf_models.py) is imported; kiln's logits equal transformers'; a few AdamW steps on
the same batches give transformers' losses; the export reloads in transformers with the trained weights bit for
bit. Bad folders are refused with one line naming the key and the file. (Llama: tests/unit/test_hf.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.api.load import parse
from kiln.errors import KilnError
from kiln.trainer.model import hf_folder as hf, kernels
from tests.hf_models import FAMILIES, save_model
from tests.support.families import STEPS, batches, exported, imported, step

@pytest.fixture(autouse=True)
def reference_kernels():
    kernels.set_mode("reference")  # CPU: the reference is what runs anyway; explicit for the record
    yield
    kernels.set_mode("fused")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(tmp_path, family):
    """The family's own folder (Gemma's tied, as published): each departure from Llama switched off alone moved
    these logits by 6e-3 or more, so dropping one fails the 1e-4 bound."""
    reference = save_model(tmp_path / family, family, tokenizer=False)
    model, _ = imported(tmp_path / family)
    tokens = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_steps_match_transformers_and_export_reloads_bit_for_bit(tmp_path, family):
    """Both models take the same AdamW steps on the same batch (untied embeddings: kiln unties them, so a tied
    reference would train another model). The tolerance: fp32 forward/backward in another operation order
    differ by ~1e-7 relative; three Adam steps (lr 1e-3, so each weight moves <= 3e-3) keep the losses within
    1e-5 relative, measured 1e-7 to 1e-6 here."""
    reference = save_model(tmp_path / "src", family, tokenizer=False,
                           config_overrides={"tie_word_embeddings": False}).train()
    model, base = imported(tmp_path / "src")
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ours, theirs = [], []
    batch = batches(1)[0]  # the same batch each step: its loss must fall
    for _ in range(STEPS):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = model(inputs, targets)
        ref_loss = torch.nn.functional.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten())
        step((opt, loss), (opt_ref, ref_loss))
        ours.append(loss.item())
        theirs.append(ref_loss.item())
    assert ours == pytest.approx(theirs, rel=1e-5, abs=0)
    assert ours[0] > ours[1] > ours[2]  # it trained

    reloaded = exported(model, base, tmp_path / "out")
    assert type(reloaded) is type(reference)
    theirs_state = reloaded.state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(theirs_state[hf.hf_name(name, model.dims.arch)], param.detach()), name
    tokens = batches(2)[1]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(tokens).logits, model(tokens), rtol=0, atol=1e-4)


# -- bad input: one line naming the key and the file, from kiln.api.hf (torch-free, before any process) ----------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("families") / "gemma3"
    save_model(path, "gemma3", tokenizer=False)
    return path


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
     r"architectures \['MambaForCausalLM'\] / model_type 'mamba' is not supported; kiln trains LlamaForCausalLM"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]},  # the multimodal Gemma 3 under a text model_type
     r"architectures \['Gemma3ForConditionalGeneration'\] / model_type 'gemma3_text' is not supported"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention = True is not supported"),
    ({"hidden_activation": "gelu"}, r"hidden_activation = 'gelu' is not supported"),
    ({"attention_dropout": 0.1}, r"attention_dropout = 0.1 is not supported"),
    ({"sliding_window": None}, r"sliding_window = None: layers \[0\] slide, so it must be a positive integer"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer_types must list 2 of full_attention, sliding_attention"),
    ({"head_dim": 15}, r"head_dim = 15 is not a positive even integer"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"rope_parameters.full_attention: rope scaling of type 'yarn' is not supported"),
])
def test_unsupported_family_or_key_is_refused_naming_key_and_file(tmp_path, gemma3, changes, message):
    config = json.loads((gemma3 / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = parse({"spec": {"model": {"from": f"file://{tmp_path}"}}}).spec
    with pytest.raises(KilnError, match=message) as err:
        hf.resolve_dims(spec)
    line = str(err.value)
    assert "\n" not in line and f"model.from file://{tmp_path}: config.json" in line


# The shapes and keys of published checkpoints, written by the family's own transformers config class: what
# `kiln run` reads from such a folder's config.json (no weights here; the tiny models above check the maths).
PUBLISHED = {
    "Mistral-7B-v0.3": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rope_theta=1e6,
        sliding_window=None)),
    "Qwen2.5-7B": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1e6,
        sliding_window=131072, use_sliding_window=False, max_window_layers=28)),
    "Qwen3-8B": ("Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)),
    "gemma-2-9b": ("Gemma2Config", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rope_theta=1e6, rope_local_base_freq=1e4)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_are_read(name):
    import transformers

    from kiln.api.hf import dims_from_config
    from kiln.api.spec import ModelSpec

    cls, values = PUBLISHED[name]
    config = getattr(transformers, cls)(**values)
    dims = dims_from_config(config.to_dict(), ModelSpec(**{"from": "x", "seqLen": 512}), "x")
    arch = dims.arch
    assert (dims.dim, dims.layers, dims.heads, dims.kv_heads, dims.vocab_size) == (
        values["hidden_size"], values["num_hidden_layers"], values["num_attention_heads"],
        values["num_key_value_heads"], values["vocab_size"])
    assert dims.head_dim == values.get("head_dim", dims.dim // dims.heads)
    # the sliding layers are transformers' own: the config's layer_types, or all / none for Mistral and Qwen2
    types = getattr(config, "layer_types", None) or ["sliding_attention" if config.sliding_window else
                                                     "full_attention"] * dims.layers
    assert arch.sliding_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert arch.sliding_window == (values.get("sliding_window") if arch.sliding_layers else None)
    if name == "gemma-3-1b":  # 5 sliding layers with base 1e4 to each global one with 1e6
        assert len(arch.sliding_layers) == 22 and (dims.rope_theta, arch.local_rope_theta) == (1e6, 1e4)
    if name.startswith("gemma"):
        assert arch.query_scale == 256 ** -0.5 and arch.sandwich_norm and arch.activation == "gelu_tanh"
    assert arch.qkv_bias == name.startswith("Qwen2") and arch.qk_norm == (name in ("Qwen3-8B", "gemma-3-1b"))


def test_kiln_run_refuses_an_unsupported_family_before_starting_processes(tmp_path, gemma3, capsys):
    from kiln.cli.main import main

    folder = tmp_path / "mamba"
    folder.mkdir()
    config = json.loads((gemma3 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba",
                                                    "architectures": ["MambaForCausalLM"]}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "t"},
                                "spec": {"model": {"from": f"file://{folder}"}}}))
    assert main(["run", str(spec), "--output", str(tmp_path / "run")]) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was started or written
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"model.from file://{folder}: config.json" in lines[0], lines
    assert "model_type 'mamba' is not supported" in lines[0], lines
