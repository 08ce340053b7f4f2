"""Model size presets and the resolution of a ModelSpec into concrete dimensions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # spec.py imports PRESETS (the preset enum); only the type is needed here
    from kiln.api.spec import ModelSpec


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling (config.json rope_scaling of type llama3)."""

    model_config = ConfigDict(frozen=True)
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class Arch(BaseModel):
    """How a model family departs from kiln's Llama, as data (kiln.api.hf sets it from config.json; the
    defaults are Llama). One parametrised transformer reads these flags: docs/trainer.md says why."""

    model_config = ConfigDict(frozen=True)
    family: str = "llama"  # config.json model_type, written back on export
    head_dim: int | None = None  # None: dim / heads (Qwen3, Gemma and Mistral-Nemo set their own)
    qkv_bias: bool = False  # Qwen2: biases on q/k/v; attention_bias: on q/k/v and o
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm of each query and key head (over head_dim) before RoPE
    activation: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU)
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight), weights stored around 0
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(dim)
    sandwich_norm: bool = False  # Gemma: a norm after attention and after the MLP too, before each residual add
    query_scale: float | None = None  # Gemma: scores scaled by query_pre_attn_scalar^-0.5, not head_dim^-0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # a sliding layer's query sees the last `sliding_window` positions
    sliding_layers: tuple[int, ...] = ()  # which layers slide (Mistral: all; Gemma: interleaved)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (None: rope_theta)


class MoEDims(BaseModel):
    """A mixture-of-experts feed-forward in place of the dense MLP (kiln.trainer.model.moe): from a preset, the
    spec's model.moe or a model folder's config.json (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    model_config = ConfigDict(frozen=True)
    experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    ffn_dim: int  # each expert's SwiGLU hidden size
    score: str = "softmax"  # router scores: softmax over the experts (Mixtral, Qwen) or a sigmoid per expert
    norm_topk: bool = True  # the k chosen scores renormalised to sum to 1 (Mixtral always; Qwen's norm_topk_prob)
    shared_ffn_dim: int = 0  # a shared expert every token takes (Qwen2-MoE), 0: none
    shared_gate: bool = False  # Qwen2-MoE: the shared expert scaled by sigmoid(a Linear(dim, 1))
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (Qwen's mlp_only_layers, decoder_sparse_step)
    aux_loss_coef: float = 0.0  # load-balancing loss weight (transformers' router_aux_loss_coef)
    z_loss_coef: float = 0.0  # router z-loss weight: mean over tokens of logsumexp(router logits)^2


class ModelDims(BaseModel):
    """Concrete model dimensions, every field set (what the trainer builds)."""

    model_config = ConfigDict(frozen=True)
    dim: int
    layers: int
    heads: int
    kv_heads: int
    vocab_size: int
    seq_len: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = None  # only from a model folder's config.json (kiln.api.hf)
    arch: Arch = Arch()  # the family's departures from Llama, only from a model folder's config.json
    moe: MoEDims | None = None  # experts in place of the dense MLP (ffn_dim: the dense layers' MLP, if any)

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim or self.dim // self.heads


def llama_ffn_dim(dim: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    """Llama's SwiGLU hidden size: 2/3 of 4*dim, scaled, rounded up to a multiple."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


PRESETS: dict[str, dict] = {
    # CPU-sized: trains in minutes on two cores with the byte tokenizer.
    "tiny": dict(dim=128, layers=4, heads=4, kv_heads=2, vocab_size=256, seq_len=128, ffn_dim=352),
    "small": dict(dim=512, layers=8, heads=8, kv_heads=4, vocab_size=32000, seq_len=1024, ffn_dim=1408),
    # CPU-sized mixture of experts: tiny's attention, 8 SwiGLU experts of hidden 176, top-2 (active FFN
    # parameters per token = tiny's 352-wide MLP; tests/bench/bench_moe.py compares the two)
    "tiny-moe": dict(dim=128, layers=4, heads=4, kv_heads=2, vocab_size=256, seq_len=128, ffn_dim=352,
                     moe=dict(experts=8, top_k=2, ffn_dim=176, aux_loss_coef=0.01, z_loss_coef=0.001)),
    # Llama 3.2 1B shape (tied embeddings not used here).
    "llama-1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, vocab_size=128256, seq_len=2048, ffn_dim=8192,
                     rope_theta=500000.0),
    # Llama 3.1 8B shape.
    "llama-8b": dict(dim=4096, layers=32, heads=32, kv_heads=8, vocab_size=128256, seq_len=4096, ffn_dim=14336,
                     rope_theta=500000.0),
}


def resolve_model(spec: ModelSpec) -> ModelDims:
    """Preset values, overridden by every explicit field; raises ValueError naming what is missing.

    A spec with model.from has its dimensions in the folder's config.json: kiln.api.hf.dims_from_config."""
    if spec.from_ is not None:
        raise ValueError(f"model.from {spec.from_}: the dimensions are in the folder's config.json; read it with "
                         f"kiln.trainer.model.hf_folder.resolve_dims")
    values: dict = {}
    if spec.preset is not None:
        if spec.preset not in PRESETS:
            raise ValueError(f"model.preset {spec.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        values.update(PRESETS[spec.preset])
    explicit = spec.model_dump(exclude={"preset", "from_", "adapter", "moe"}, exclude_none=True)
    values.update(explicit)
    moe = moe_dims(values.get("moe"), spec.moe)
    if moe is not None:
        values["moe"] = moe
        if mixtral_like(moe):  # Llama's attention with Mixtral's experts: exported as a Mixtral folder
            values["arch"] = Arch(family="mixtral")
    if "dim" in values and "ffn_dim" not in values:
        values["ffn_dim"] = llama_ffn_dim(values["dim"])
    if "heads" in values and "kv_heads" not in values:
        values["kv_heads"] = values["heads"]
    missing = [f for f in ("dim", "layers", "heads", "vocab_size", "seq_len") if f not in values]
    if missing:
        raise ValueError(f"model: set a preset or all of dim, layers, heads, vocabSize, seqLen (missing: {', '.join(missing)})")
    return ModelDims(**values)


def mixtral_like(moe: MoEDims) -> bool:
    """Whether these experts are Mixtral's: softmax scores, the top-k renormalised, no shared expert, every
    layer sparse (a preset's or spec's MoE with Llama's attention is then a Mixtral model)."""
    return moe.score == "softmax" and moe.norm_topk and not moe.shared_ffn_dim and not moe.dense_layers


def moe_dims(base: dict | MoEDims | None, spec) -> MoEDims | None:
    """The preset's (or config.json's) MoE dims with the spec's model.moe fields over them; ValueError naming
    what is missing when the spec asks for experts without saying how many."""
    values = base.model_dump() if isinstance(base, MoEDims) else dict(base or {})
    if spec is not None:
        values.update(spec.model_dump(exclude_none=True))
    if not values:
        return None
    missing = [wire for f, wire in (("experts", "experts"), ("top_k", "topK"), ("ffn_dim", "ffnDim")) if f not in values]
    if missing:
        raise ValueError(f"model.moe: set {', '.join(missing)} (no preset or model folder gives them)")
    if values["top_k"] > values["experts"]:
        raise ValueError(f"model.moe.topK {values['top_k']} exceeds model.moe.experts {values['experts']}")
    return MoEDims(**values)
