"""spec.model: the model to train (a preset, explicit dimensions or a Hugging Face folder) and its LoRA adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.base import ApiModel
from kiln.api.presets import PRESETS
from kiln.api.spec.limits import INT32_MAX, JSON_INT_MAX


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the names in kiln.api.presets, one source


# LoRA's target modules, by their transformers / peft names (q_proj, ...; what `target_modules` says in a peft
# adapter_config.json): the attention and MLP projections every block has.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' routed experts, by the stacked parameters transformers holds them in (peft's
# `target_parameters`: mlp.experts.gate_up_proj, the gate and up projections fused, and mlp.experts.down_proj).
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
LoraTarget = Literal[LORA_TARGETS + EXPERT_TARGETS]  # type: ignore[valid-type]


class AdapterSpec(ApiModel):
    """Train low-rank adapters instead of every weight (LoRA, Hu et al. 2021): each target projection W gets
    y = W x + (alpha / rank) · B A x with A (rank × in) and B (out × rank) trained and W frozen. Checkpoints hold
    the adapters and their optimizer state only (plus the base model's identity); `kiln export --format peft`
    writes them as a peft adapter folder, `--format hf --merge` the merged model."""

    type: Literal["lora"] = Field("lora", description="The adapter kind: lora.")
    rank: int = Field(16, ge=1, le=INT32_MAX, description="Rank r of each adapter: A is r × in, B is out × r.")
    alpha: float = Field(32.0, gt=0, le=1e6, description="Scale numerator: the update B A is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (0: none).")
    targets: list[LoraTarget] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1, max_length=len(LORA_TARGETS + EXPERT_TARGETS),
        description="The projections of every block that get an adapter, by their transformers names: q_proj, "
        "k_proj, v_proj, o_proj (attention), gate_proj, up_proj, down_proj (MLP; a mixture of experts' shared "
        "expert too). Default: all seven. A mixture of experts' routed experts: experts.gate_up_proj, "
        "experts.down_proj (one adapter per expert, as peft's target_parameters; no dropout).",
    )


class MoESpec(ApiModel):
    """Mixture of experts (kiln.trainer.model.moe): each MoE layer routes every token to topK of `experts` SwiGLU
    experts (token-choice, no capacity: no token is dropped). A preset or model folder sets the shape; fields
    here override it (a folder's shape fields must be left unset)."""

    experts: int | None = Field(None, ge=2, le=INT32_MAX, description="Routed experts per MoE layer.")
    top_k: int | None = Field(None, ge=1, le=INT32_MAX, description="Experts each token is routed to; at most experts.")
    ffn_dim: int | None = Field(None, ge=8, le=JSON_INT_MAX, description="Each expert's SwiGLU hidden size.")
    score: Literal["softmax", "sigmoid"] | None = Field(
        None, description="Router scores: softmax over the experts (Mixtral, Qwen-MoE; default) or a sigmoid per expert.")
    norm_topk: bool | None = Field(
        None, description="Renormalise the topK chosen scores to sum to 1 (default true; Qwen-MoE's norm_topk_prob).")
    shared_ffn_dim: int | None = Field(
        None, ge=0, le=JSON_INT_MAX, description="Hidden size of a shared expert every token also takes (0: none).")
    aux_loss_coef: float | None = Field(
        None, ge=0, le=1e3, description="Weight of the load-balancing loss added to the training loss (Switch "
        "Transformer's, as transformers computes it: experts × Σ_e tokens share_e × mean router probability_e over "
        "all MoE layers). Default: the preset's, or the model folder's router_aux_loss_coef.")
    z_loss_coef: float | None = Field(
        None, ge=0, le=1e3, description="Weight of the router z-loss (mean over tokens and MoE layers of "
        "logsumexp(router logits)²) added to the training loss. Default: the preset's, else 0.")


class ModelSpec(ApiModel):
    """Which model to train: a named preset, optionally with explicit dimensions overriding it, or a model
    folder in Hugging Face layout (model.from) whose weights training starts from."""

    preset: PresetName | None = Field(
        None,
        description="Named model size: tiny (CPU tests), tiny-moe (tiny with 8 experts, top-2), small, llama-1b, llama-8b. Explicit fields override it; "
        "without a preset or from, set all of dim, layers, heads, vocabSize, seqLen.",
    )
    from_: str | None = Field(
        None, alias="from", max_length=1024,
        description="A Llama-family model folder in Hugging Face layout to start from (config.json, model.safetensors "
        "or sharded with model.safetensors.index.json, tokenizer files): file:///path/ or s3://bucket/prefix/. Its "
        "config.json sets the dimensions (explicit fields must agree with it; seqLen is free up to "
        "max_position_embeddings, default min(2048, it)). A resumed run loads its own checkpoints, not this.",
    )
    dim: int | None = Field(None, ge=8, le=JSON_INT_MAX, description="Hidden size (model width).")
    layers: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Number of transformer blocks.")
    heads: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Attention heads.")
    kv_heads: int | None = Field(None, ge=1, le=JSON_INT_MAX, description="Key/value heads for grouped-query attention; divides heads.")
    vocab_size: int | None = Field(None, ge=2, le=JSON_INT_MAX, description="Vocabulary size (256 for the built-in byte tokenizer).")
    seq_len: int | None = Field(None, ge=2, le=JSON_INT_MAX, description="Tokens per training sequence.")
    ffn_dim: int | None = Field(None, ge=8, le=JSON_INT_MAX, description="Hidden size of the SwiGLU MLP; derived from dim when unset.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    moe: MoESpec | None = Field(
        None, description="Mixture-of-experts feed-forward layers in place of the dense MLP (preset tiny-moe, or a "
        "Mixtral / Qwen2-MoE / Qwen3-MoE model folder, set it; fields here override).",
    )
    adapter: AdapterSpec | None = Field(
        None, description="Fine-tune with LoRA adapters: the model's own weights (model.from's, else the seed's) "
        "stay frozen, in training.precision; only the adapters and their optimizer state are trained and saved.",
    )
