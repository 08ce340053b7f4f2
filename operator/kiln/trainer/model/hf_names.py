"""The Hugging Face folder's vocabulary, which reading (kiln.trainer.model.hf_folder) and writing
(kiln.trainer.model.hf_export) share: its file names, the safetensors dtypes, and the family mappings from kiln's
parameter names to transformers' (`NAME_MAP`, the same for every family kiln reads but Gemma's extra norms).
"""

from __future__ import annotations

import re

import torch

from kiln.api import ModelDims
from kiln.api.presets import Arch


CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# kiln parameter name -> transformers' name ({i}: the block index, the same on both sides). The same in every
# family kiln reads (Llama, Mistral, Qwen2/3, Gemma 2/3: their *ForCausalLM classes share these names), but
# for Gemma's extra norms, which move `post_attention_layernorm` to the attention's output (SANDWICH_NAMES).
NAME_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.attention.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.attention.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attention.wo.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


SANDWICH_NAMES = {
    "layers.{i}.attention_post_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers.{i}.ffn_post_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(kiln_name: str, arch: Arch = Arch()) -> str:
    names = {**NAME_MAP, **SANDWICH_NAMES} if arch.sandwich_norm else NAME_MAP
    m = _LAYER.match(kiln_name)
    if m:
        return names["layers.{i}." + m.group(2)].format(i=m.group(1))
    return names[kiln_name]


def hf_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor of the transformers model with these dims, by its name, with its shape: those of kiln's
    model (built on the meta device), renamed."""
    from kiln.trainer.model.transformer import build_model

    return {hf_name(n, dims.arch): tuple(p.shape) for n, p in build_model(dims).named_parameters()}
