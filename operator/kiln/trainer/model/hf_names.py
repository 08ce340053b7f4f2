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


# A mixture of experts' feed-forward (kiln.trainer.model.moe): kiln's names under `layers.{i}.feed_forward.` ->
# transformers' under `model.layers.{i}.<MOE_PREFIX>.`. The experts are stacked in kiln (one (experts, out, in)
# tensor per weight) and one tensor per expert in transformers' files: `experts.{e}.<EXPERT_WEIGHTS>.weight`.
MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp"}
MOE_NAMES = {
    "router.gate.weight": "gate.weight",
    "shared_experts.w1.weight": "shared_expert.gate_proj.weight",
    "shared_experts.w3.weight": "shared_expert.up_proj.weight",
    "shared_experts.w2.weight": "shared_expert.down_proj.weight",
    "shared_gate.weight": "shared_expert_gate.weight",
}
EXPERT_WEIGHTS = {"mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
                  "qwen": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")


def hf_name(kiln_name: str, arch: Arch = Arch()) -> str:
    names = {**NAME_MAP, **SANDWICH_NAMES} if arch.sandwich_norm else NAME_MAP
    m = _LAYER.match(kiln_name)
    if m:
        rest = m.group(2)
        if rest.startswith("feed_forward.") and rest[len("feed_forward."):] in MOE_NAMES:
            return f"model.layers.{m.group(1)}.{MOE_PREFIX[arch.family]}.{MOE_NAMES[rest[len('feed_forward.'):]]}"
        return names["layers.{i}." + rest].format(i=m.group(1))
    return names[kiln_name]


def hf_names(kiln_name: str, arch: Arch, experts: int = 0) -> list[str]:
    """transformers' names of a kiln parameter: one, or for stacked experts one per expert (in expert order)."""
    m = EXPERTS.match(kiln_name)
    if m is None:
        return [hf_name(kiln_name, arch)]
    weight = EXPERT_WEIGHTS["mixtral" if arch.family == "mixtral" else "qwen"][m.group(2)]
    prefix = f"model.layers.{m.group(1)}.{MOE_PREFIX[arch.family]}.experts"
    return [f"{prefix}.{e}.{weight}.weight" for e in range(experts)]


def experts_of(dims: ModelDims) -> int:
    return dims.moe.experts if dims.moe is not None else 0


def hf_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor of the transformers model with these dims, by its name, with its shape: those of kiln's
    model (built on the meta device), renamed."""
    from kiln.trainer.model.transformer import build_model

    out = {}
    for n, p in build_model(dims).named_parameters():
        stacked = EXPERTS.match(n) is not None
        out.update({name: tuple(p.shape[1:] if stacked else p.shape) for name in hf_names(n, dims.arch, experts_of(dims))})
    return out
