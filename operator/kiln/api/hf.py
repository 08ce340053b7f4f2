"""A Hugging Face model folder's config.json → kiln's model dimensions (pure: a dict in, ModelDims out).

Used by the trainer (every rank, before any weight is read) and by `kiln run` (before any process starts);
the operator never reads model folders. The families below are accepted (`model_type`, and `architectures`
when the config lists it); what a family departs from Llama in becomes data (`kiln.api.presets.Arch`) that
kiln's one transformer reads. Any other family, and any key value kiln does not implement, is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.api.presets import Arch, ModelDims, MoEDims, RopeScaling, moe_dims

if TYPE_CHECKING:
    from kiln.api.spec import ModelSpec

# model_type -> the transformers class its config.json names in `architectures`
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ARCHITECTURES = tuple(FAMILIES.values())
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
GEMMA = ("gemma2", "gemma3_text")
DEFAULT_SEQ_LEN = 2048  # model.seqLen when a model folder is used and seqLen is unset (capped by the config)

# kiln ModelSpec field (snake_case) -> config.json key, for the dimensions a config fixes.
CONFIG_KEYS = {
    "dim": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}
# config.json values kiln implements, per key: anything else is refused naming the key
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _camel(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(p.title() for p in rest)


def rope_settings(config: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from either config layout: transformers < 5 writes `rope_theta` and
    `rope_scaling`; transformers >= 5 writes `rope_parameters` with rope_type and rope_theta inside, or (Gemma 3)
    one such dict per layer type."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if kind == "default" else dict(params))
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), (dict(scaling) if isinstance(scaling, dict) else None)


def _llama3_scaling(scaling: dict[str, Any] | None, where: str) -> RopeScaling | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"{where}: rope scaling of type {kind!r} is not supported (only 'llama3' or none)")
    try:
        return RopeScaling(factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                           high_freq_factor=scaling["high_freq_factor"],
                           original_max_position_embeddings=scaling["original_max_position_embeddings"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"{where}: rope scaling llama3 needs factor, low_freq_factor, high_freq_factor and "
                         f"original_max_position_embeddings ({err})") from None


def _sliding_layers(config: dict[str, Any], family: str, layers: int, where: str) -> tuple[int, ...]:
    """Which layers attend through a sliding window: `layer_types` when the config lists them (transformers
    >= 4.53 writes them), else the family's own rule as transformers applies it."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{where}: layer_types must list {layers} of {', '.join(LAYER_TYPES)}")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if family in ("mistral", "mixtral"):
        return tuple(range(layers)) if config.get("sliding_window") is not None else ()
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = config.get("max_window_layers", layers)
        return tuple(range(first, layers)) if config.get("use_sliding_window") else ()
    if family == "gemma2":
        return tuple(range(0, layers, 2))
    if family == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6)
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    return ()


def _refuse(config: dict[str, Any], where: str, **supported: tuple) -> None:
    """Each key (when present and not null) must hold one of the values kiln implements."""
    for key, values in supported.items():
        if config.get(key) is not None and config[key] not in values:
            raise ValueError(f"{where}: {key} = {config[key]!r} is not supported (kiln implements "
                             f"{' or '.join(repr(v) for v in values)})")


def arch_from_config(config: dict[str, Any], family: str, layers: int, where: str) -> Arch:
    """The family's departures from Llama, from its config.json keys (transformers' meaning of each)."""
    gemma = family in GEMMA
    act_key = "hidden_activation" if gemma and "hidden_activation" in config else "hidden_act"
    _refuse(config, where, **{act_key: tuple(ACTIVATIONS)}, mlp_bias=(False,), attention_dropout=(0, 0.0),
            use_bidirectional_attention=(False,), attention_bias=(False, True))
    activation = ACTIVATIONS[config.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")]
    # Qwen2 always has q/k/v biases and none on o, Qwen2-MoE as its qkv_bias says; elsewhere attention_bias sets
    # all four (Mistral and Mixtral have none)
    bias = bool(config.get("attention_bias", False)) and family not in ("mistral", "mixtral")
    qkv_bias = bias or family == "qwen2" or (family == "qwen2_moe" and bool(config.get("qkv_bias", True)))
    sliding = _sliding_layers(config, family, layers, where)
    window = config.get("sliding_window") if sliding else None
    if sliding and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window = {window!r}: layers {list(sliding)} slide, so it must be a "
                         f"positive integer")
    scalar = config.get("query_pre_attn_scalar") if gemma else None
    local_theta = rope_settings(config, "sliding_attention")[0] if family == "gemma3_text" else None
    if family == "gemma3_text" and "rope_parameters" not in config:  # the transformers < 5 layout
        local_theta = float(config.get("rope_local_base_freq", 10000.0))
    return Arch(
        family=family, head_dim=config.get("head_dim"), qkv_bias=qkv_bias, o_bias=bias,
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"), activation=activation, norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma, sandwich_norm=gemma, query_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=config.get("attn_logit_softcapping") if gemma else None,
        final_softcap=config.get("final_logit_softcapping") if gemma else None,
        sliding_window=window, sliding_layers=sliding, local_rope_theta=local_theta)


def moe_from_config(config: dict[str, Any], family: str, layers: int, where: str) -> MoEDims | None:
    """A Mixtral / Qwen-MoE config's experts (transformers' meaning of each key); None for a dense family."""
    if family not in MOE:
        return None
    _refuse(config, where, router_jitter_noise=(0, 0.0))  # Mixtral's training-time input noise: not implemented
    experts = config.get("num_local_experts", config.get("num_experts"))
    top_k = config.get("num_experts_per_tok")
    hidden = config.get("intermediate_size") if family == "mixtral" else config.get("moe_intermediate_size")
    bad = [k for k, v in (("num_local_experts" if family != "qwen2_moe" else "num_experts", experts),
                          ("num_experts_per_tok", top_k),
                          ("intermediate_size" if family == "mixtral" else "moe_intermediate_size", hidden))
           if not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"{where}: missing or not a positive integer: {', '.join(bad)}")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} exceeds the {experts} experts")
    dense: tuple[int, ...] = ()
    if family != "mixtral":  # transformers: a layer is sparse unless in mlp_only_layers or off decoder_sparse_step
        step, only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        if not isinstance(step, int) or step < 1 or not isinstance(only, list):
            raise ValueError(f"{where}: decoder_sparse_step must be a positive integer and mlp_only_layers a list")
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = config.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return MoEDims(experts=experts, top_k=top_k, ffn_dim=hidden, score="softmax",
                   norm_topk=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
                   shared_ffn_dim=shared or 0, shared_gate=bool(shared), dense_layers=dense,
                   aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))


def moe_config(dims: ModelDims) -> dict[str, Any]:
    """The config.json keys of dims.moe in its family's names (the inverse of moe_from_config)."""
    c, family = dims.moe, dims.arch.family
    if c is None:
        return {}
    out = {"num_experts_per_tok": c.top_k, "router_aux_loss_coef": c.aux_loss_coef, "output_router_logits": False}
    if family == "mixtral":
        return {**out, "num_local_experts": c.experts, "intermediate_size": c.ffn_dim}
    out.update(num_experts=c.experts, moe_intermediate_size=c.ffn_dim, norm_topk_prob=c.norm_topk,
               decoder_sparse_step=1, mlp_only_layers=list(c.dense_layers))
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = c.shared_ffn_dim
    return out


def dims_from_config(config: dict[str, Any], model: "ModelSpec", source: str) -> ModelDims:
    """The dimensions a config.json describes; explicit `model` fields must agree with it (seqLen is a free
    choice up to max_position_embeddings). ValueError naming the key or field and `source` otherwise."""
    where = f"model.from {source}: config.json"
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in FAMILIES or (archs and FAMILIES[model_type] not in archs):
        raise ValueError(
            f"{where}: architectures {archs} / model_type {model_type!r} is not supported; kiln trains "
            + ", ".join(f"{a} ({t})" for t, a in FAMILIES.items()))
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if not isinstance(config.get(k), int) or config[k] < 1]
    if missing:
        raise ValueError(f"{where}: missing or not a positive integer: {', '.join(missing)}")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ValueError(f"{where}: head_dim = {head_dim!r} is not a positive even integer (RoPE rotates pairs)")
    arch = arch_from_config(config, model_type, layers, where)
    if arch.head_dim == config["hidden_size"] // heads:
        arch = arch.model_copy(update={"head_dim": None})  # the default: one less thing to write back
    theta, scaling = rope_settings(config)
    values = {
        "dim": config["hidden_size"], "layers": layers, "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads, "vocab_size": config["vocab_size"],
        "ffn_dim": config["intermediate_size"], "rope_theta": theta,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
    }
    conflicts = [f"{_camel(f)}={getattr(model, f)} but config.json {CONFIG_KEYS[f]}={values[f]}"
                 for f in CONFIG_KEYS if getattr(model, f) is not None and getattr(model, f) != values[f]]
    if conflicts:
        raise ValueError(f"model: explicit fields contradict the model folder {source} ({'; '.join(conflicts)}); "
                         f"leave them unset, the folder's config.json sets them")
    max_pos = config.get("max_position_embeddings")
    seq_len = model.seq_len or (min(DEFAULT_SEQ_LEN, max_pos) if isinstance(max_pos, int) else DEFAULT_SEQ_LEN)
    if isinstance(max_pos, int) and seq_len > max_pos:
        raise ValueError(f"model.seqLen {seq_len} exceeds the model's max_position_embeddings {max_pos} "
                         f"(config.json of {source})")
    rope_where = f"{where}: rope_parameters.full_attention" if arch.local_rope_theta else where
    if arch.local_rope_theta is not None and rope_settings(config, "sliding_attention")[1] is not None:
        raise ValueError(f"{where}: rope_parameters.sliding_attention: only rope_type 'default' is supported")
    moe = moe_dims(moe_from_config(config, model_type, layers, where), model.moe)
    if moe is not None and model.moe is not None:
        shape = [f for f in ("experts", "top_k", "ffn_dim", "score", "norm_topk", "shared_ffn_dim")
                 if getattr(model.moe, f) is not None]
        if shape:
            raise ValueError(f"model.moe.{_camel(shape[0])}: the model folder {source} sets the experts' shape; "
                             f"leave it unset (auxLossCoef and zLossCoef are free)")
    elif model.moe is not None:
        raise ValueError(f"model.moe: the model folder {source} is a dense {model_type} model, not a mixture of experts")
    return ModelDims(**values, seq_len=seq_len, rope_scaling=_llama3_scaling(scaling, rope_where), arch=arch, moe=moe)


def config_for(dims: ModelDims, *, tie: bool = False, dtype: str = "float32",
               base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of an exported model: `base` (the imported model's config, its token ids, layer types
    and other keys kept) with every dimension set from `dims`, in the transformers < 5 layout that both 4.x and
    5.x read."""
    arch = dims.arch
    if dims.moe is not None and arch.family not in MOE:
        raise ValueError(f"model.moe: no transformers family has these experts (score {dims.moe.score}, normTopk "
                         f"{dims.moe.norm_topk}, sharedFfnDim {dims.moe.shared_ffn_dim}); kiln exports Mixtral's "
                         f"(softmax, normTopk true, no shared expert) or a Qwen-MoE folder's own")
    config = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False} if arch.family == "llama" else {}
    config.update({k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "torch_dtype", "dtype")})
    config.update({
        "architectures": [FAMILIES[arch.family]], "model_type": arch.family, "head_dim": dims.head_dim,
        **{key: getattr(dims, field) for field, key in CONFIG_KEYS.items()},
        "max_position_embeddings": max(dims.seq_len, config.get("max_position_embeddings") or 0),
        "tie_word_embeddings": tie, "torch_dtype": dtype,
    })
    if arch.local_rope_theta is not None:
        config["rope_local_base_freq"] = arch.local_rope_theta
    config.update(moe_config(dims))
    config.pop("rope_scaling", None)
    if dims.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dims.rope_scaling.model_dump()}
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)
    return config
