"""Hugging Face folders in one process: the config mapping, kiln's ranged safetensors reads against the
`safetensors` library, import → export gives back identical tensors, and every bad input is a KilnError
that names the key or tensor (models made by transformers itself: tests/hf_models.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from kiln.api.hf import dims_from_config
from kiln.api.load import parse
from kiln.api.spec import ModelSpec
from kiln.errors import KilnError
from kiln.storage import open_store
from kiln.trainer.model import hf_export, hf_folder as hf
from kiln.trainer.model.transformer import build_model
from tests.hf_models import VARIANTS, VOCAB, make_tokenizer, save_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "gqa"
    save_model(path, "gqa")
    return path


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def spec_for(uri: str, **model):
    return parse({"spec": {"model": {"from": uri, **model}}}).spec


def imported(uri: str, **model) -> torch.nn.Module:
    spec = spec_for(uri, **model)
    dims = hf.resolve_dims(spec)
    m = build_model(dims)
    m.to_empty(device="cpu")
    m.init_buffers()
    hf.load_weights(m, uri, dims)
    return m


# -- the mapping and the reader --------------------------------------------------------------------------------------


def test_config_sets_the_dims_and_seq_len_defaults_to_2048_capped_by_the_config(folder):
    config = json.loads((folder / "config.json").read_text())
    dims = dims_from_config(config, ModelSpec(**{"from": "x"}), "x")
    assert (dims.dim, dims.layers, dims.heads, dims.kv_heads, dims.vocab_size, dims.ffn_dim) == (32, 2, 4, 2, VOCAB, 64)
    assert dims.seq_len == 64 and dims.rope_scaling is None  # max_position_embeddings 64 < 2048
    assert dims_from_config({**config, "max_position_embeddings": 131072}, ModelSpec(**{"from": "x"}), "x").seq_len == 2048
    # the transformers < 5 layout of the same settings
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    scaled = dims_from_config(old, ModelSpec(**{"from": "x"}), "x")
    assert scaled.rope_theta == 500000.0 and scaled.rope_scaling.factor == 8.0


def test_ranged_reads_equal_safetensors_own_slices(folder):
    from safetensors import safe_open

    ckpt = hf.Checkpoint(f"file://{folder}")
    with safe_open(str(folder / "model.safetensors"), "pt") as st:
        assert set(st.keys()) == set(ckpt.tensors)
        for name in st.keys():
            entry, sl = ckpt.tensors[name], st.get_slice(name)
            shape = sl.get_shape()
            assert list(entry.shape) == shape
            if len(shape) == 2:
                got = hf.read_slice(ckpt.store, entry, (3, 5), (7, shape[1] - 9))
                assert torch.equal(got, sl[3:10, 5:shape[1] - 4])
            got = hf.read_slice(ckpt.store, entry, (1,) + (0,) * (len(shape) - 1), (shape[0] - 2, *shape[1:]))
            assert torch.equal(got, sl[1:shape[0] - 1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_then_export_gives_back_identical_tensors(tmp_path, variant):
    from safetensors import safe_open
    from safetensors.torch import load_file

    src = tmp_path / "src"
    save_model(src, variant, tokenizer=False)
    model = imported(f"file://{src}")
    out = open_store(f"file://{tmp_path / 'out'}")
    hf_export.write_folder(hf_export.hf_state(model, torch.float32), out, config={}, generation={},
                           tokenizer_files={}, max_shard_bytes=1 << 30)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    with safe_open(str(src / "model.safetensors"), "pt") as st:
        for name in st.keys():
            assert torch.equal(exported[name], st.get_tensor(name)), name
        if variant == "tied":  # untied on export: the output layer is written, equal to the embedding
            assert "lm_head.weight" not in st.keys()
            assert torch.equal(exported["lm_head.weight"], st.get_tensor("model.embed_tokens.weight"))
        else:
            assert set(exported) == set(st.keys())


def test_bf16_folder_round_trips_bit_exactly(tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "src"
    base = save_model(src, "gqa", tokenizer=False)
    base.to(torch.bfloat16).save_pretrained(src)
    model = imported(f"file://{src}")
    assert next(model.parameters()).dtype == torch.float32  # kiln's master weights; bf16 -> fp32 is exact
    out = open_store(f"file://{tmp_path / 'out'}")
    hf_export.write_folder(hf_export.hf_state(model, torch.bfloat16), out, config={}, generation={},
                           tokenizer_files={}, max_shard_bytes=1 << 30)
    want, got = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_shard_plan_keeps_order_and_limit():
    assert hf_export.shard_plan({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]


# -- bad input: a KilnError naming the key or tensor ------------------------------------------------------------------


def rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["MistralForCausalLM"]},  # another family's class under model_type llama
     r"architectures \['MistralForCausalLM'\] / model_type 'llama' is not supported"),
    ({"mlp_bias": True}, r"mlp_bias = True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope scaling of type 'yarn' is not supported"),
    ({"head_dim": 15}, r"head_dim = 15 is not a positive even integer"),
    ({"num_hidden_layers": None}, r"missing or not a positive integer: num_hidden_layers"),
    ({"num_attention_heads": 0}, r"missing or not a positive integer: num_attention_heads"),
])
def test_unsupported_config_is_refused_by_key(tmp_path, folder, changes, message):
    bad = copy_folder(folder, tmp_path / "bad")
    rewrite_config(bad, **changes)
    with pytest.raises(KilnError, match=message):
        hf.resolve_dims(spec_for(f"file://{bad}"))


def test_explicit_fields_that_contradict_the_config_are_refused(folder):
    with pytest.raises(KilnError, match=r"dim=64 but config.json hidden_size=32; kvHeads=4 but config.json "
                                        r"num_key_value_heads=2"):
        hf.resolve_dims(spec_for(f"file://{folder}", dim=64, kvHeads=4))
    assert hf.resolve_dims(spec_for(f"file://{folder}", dim=32, seqLen=16)).seq_len == 16  # agreeing: fine
    with pytest.raises(KilnError, match=r"model.seqLen 128 exceeds the model's max_position_embeddings 64"):
        hf.resolve_dims(spec_for(f"file://{folder}", seqLen=128))


def test_kiln_run_refuses_a_contradiction_before_starting_processes(tmp_path, folder):
    from kiln.cli.main import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "t"},
                                "spec": {"model": {"from": f"file://{folder}", "layers": 3}}}))
    assert main(["run", str(spec), "--output", str(tmp_path / "run")]) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was started or written


def resave(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"tensor model.layers.1.mlp.up_proj.weight is missing"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
     r"tensor model.layers.0.self_attn.q_proj.bias is not part of a llama model"),
    (lambda t: t.update({"model.norm.weight": torch.ones(33)}),
     r"tensor model.norm.weight has shape \[33\], config.json needs \[32\]"),
    (lambda t: t.pop("lm_head.weight"), r"tensor lm_head.weight is missing.*tie_word_embeddings: true"),
    (lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}),
     r"tensor model.norm.weight: dtype 'I32' is not supported"),
])
def test_bad_tensors_are_refused_by_name(tmp_path, folder, change, message):
    bad = copy_folder(folder, tmp_path / "bad")
    resave(bad, change)
    with pytest.raises(KilnError, match=message):
        imported(f"file://{bad}")


def test_truncated_and_corrupt_safetensors_are_refused_naming_the_file(tmp_path, folder):
    data = (folder / "model.safetensors").read_bytes()
    cases = {
        "truncated": (data[:-100], r"model.safetensors is truncated: tensor \S+ ends at byte"),
        "short": (data[:5], r"model.safetensors is truncated \(5 bytes"),
        "length": (struct.pack("<Q", 1 << 40) + data[8:], r"corrupt or truncated safetensors header \(length"),
        "json": (data[:8] + b"{" * struct.unpack("<Q", data[:8])[0] + data[8 + struct.unpack("<Q", data[:8])[0]:],
                 r"corrupt safetensors header \(not a JSON object\)"),
    }
    for name, (content, message) in cases.items():
        bad = copy_folder(folder, tmp_path / name)
        (bad / "model.safetensors").write_bytes(content)
        with pytest.raises(KilnError, match=message):
            imported(f"file://{bad}")


def test_missing_files_are_named(tmp_path, folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KilnError, match=r"model.from file://.*empty: no config.json"):
        hf.resolve_dims(spec_for(f"file://{empty}"))
    no_weights = copy_folder(folder, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(KilnError, match=r"neither model.safetensors nor model.safetensors.index.json"):
        imported(f"file://{no_weights}")
    indexed = copy_folder(folder, tmp_path / "indexed")
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model.safetensors", "model.embed_tokens.weight": "other.safetensors"}}))
    with pytest.raises(KilnError, match=r"other.safetensors is missing \(named by model.safetensors.index.json\)"):
        imported(f"file://{indexed}")
    for bad in ({"weight_map": {"model.norm.weight": ["x"]}}, {"weight_map": {}}, ["not", "an", "object"]):
        (indexed / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(KilnError, match=r"model.safetensors.index.json (has no weight_map|is not a JSON object)"):
            imported(f"file://{indexed}")
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model.safetensors", "model.extra.weight": "model.safetensors"}}))
    with pytest.raises(KilnError, match=r"tensor model.extra.weight is listed in model.safetensors.index.json "
                                        r"under model.safetensors but that file does not hold it"):
        imported(f"file://{indexed}")


def test_tokenizer_must_fit_the_model_and_be_readable(tmp_path, folder):
    from kiln.trainer.model.hf_folder import training_tokenizer

    spec = spec_for(f"file://{folder}")
    dims = hf.resolve_dims(spec)
    assert training_tokenizer(spec, dims).get_vocab_size() == VOCAB  # the folder's own tokenizer by default
    big = tmp_path / "big.json"
    make_tokenizer(VOCAB + 40).save(str(big))
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"tokenizer": f"file://{big}"})})
    with pytest.raises(KilnError, match=rf"its vocabulary has {VOCAB + 40} tokens, more than the model's vocabSize {VOCAB}"):
        training_tokenizer(spec, dims)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(KilnError, match=r"junk.json: tokenizer.json is not a tokenizer|junk.json is not a tokenizer"):
        hf.load_tokenizer(f"file://{tmp_path / 'junk.json'}")
    with pytest.raises(KilnError, match=r"no tokenizer.json in"):
        hf.load_tokenizer(f"file://{tmp_path}/")
