"""A Hugging Face model folder's config.json → kiln's model dimensions (pure: a dict in, ModelDims out).

Used by the trainer (every rank, before any weight is read) and by `kiln run` (before any process starts);
the operator never reads model folders. Only the Llama family that kiln's own model mirrors is accepted:
RMSNorm, grouped-query attention without biases, SwiGLU (`silu`), RoPE with no scaling or Llama 3.1's
`llama3` scaling, separate or tied input/output embeddings. Anything else is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.api.presets import ModelDims, RopeScaling

if TYPE_CHECKING:
    from kiln.api.spec import ModelSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)
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


def _camel(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(p.title() for p in rest)


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from either config layout: transformers < 5 writes `rope_theta` and
    `rope_scaling`; transformers >= 5 writes `rope_parameters` with rope_type and rope_theta inside."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if kind == "default" else dict(params))
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), (dict(scaling) if isinstance(scaling, dict) else None)


def dims_from_config(config: dict[str, Any], model: "ModelSpec", source: str) -> ModelDims:
    """The dimensions a config.json describes; explicit `model` fields must agree with it (seqLen is a free
    choice up to max_position_embeddings). ValueError naming the key or field and `source` otherwise."""
    where = f"model.from {source}: config.json"
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
        raise ValueError(
            f"{where}: architectures {archs} / model_type {model_type!r} is not supported; kiln trains the Llama "
            f"family ({', '.join(SUPPORTED_ARCHITECTURES)}, model_type {', '.join(SUPPORTED_MODEL_TYPES)})")
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if config.get(key, expected) != expected:
            raise ValueError(f"{where}: {key} = {config[key]!r} is not supported (kiln's Llama has {expected!r})")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if not isinstance(config.get(k), int) or config[k] < 1]
    if missing:
        raise ValueError(f"{where}: missing or not a positive integer: {', '.join(missing)}")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        raise ValueError(f"{where}: head_dim {head_dim} x num_attention_heads {heads} != hidden_size "
                         f"{config['hidden_size']}; kiln's attention needs head_dim = hidden_size / heads")
    theta, scaling = rope_settings(config)
    rope_scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"{where}: rope scaling of type {kind!r} is not supported (only 'llama3' or none)")
        try:
            rope_scaling = RopeScaling(
                factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                high_freq_factor=scaling["high_freq_factor"],
                original_max_position_embeddings=scaling["original_max_position_embeddings"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{where}: rope scaling llama3 needs factor, low_freq_factor, high_freq_factor and "
                             f"original_max_position_embeddings ({err})") from None
    values = {
        "dim": config["hidden_size"], "layers": config["num_hidden_layers"], "heads": heads,
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
    return ModelDims(**values, seq_len=seq_len, rope_scaling=rope_scaling)


def config_for(dims: ModelDims, *, tie: bool = False, dtype: str = "float32",
               base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of an exported model: `base` (the imported model's config, its token ids and other
    keys kept) with every dimension set from `dims`, in the transformers < 5 layout that both 4.x and 5.x read."""
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "torch_dtype", "dtype")}
    config.update({
        "architectures": list(SUPPORTED_ARCHITECTURES), "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "head_dim": dims.head_dim,
        **{key: getattr(dims, field) for field, key in CONFIG_KEYS.items()},
        "max_position_embeddings": max(dims.seq_len, config.get("max_position_embeddings") or 0),
        "tie_word_embeddings": tie, "torch_dtype": dtype,
    })
    config.pop("rope_scaling", None)
    if dims.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dims.rope_scaling.model_dump()}
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)
    return config
