"""Small random models made by transformers itself (not by kiln), saved as Hugging Face folders.

The reference side of kiln's import/export tests: each family's own config class (`LlamaConfig`,
`MistralConfig`, `Qwen2Config`, `Qwen3Config`, `Gemma2Config`, `Gemma3TextConfig`; `MixtralConfig`,
`Qwen2MoeConfig`, `Qwen3MoeConfig` for the mixtures of experts) + `AutoModelForCausalLM` +
`save_pretrained`, and a byte-level BPE tokenizer trained with the `tokenizers` library on the built-in corpus.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # 256 byte symbols + 64 merges
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}

# name -> LlamaConfig overrides: GQA (4 query heads, 2 kv heads), tied embeddings, Llama 3.1 rope scaling
VARIANTS = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},
}


# name -> (transformers config class, overrides of the tiny base (dim 64, 2 layers) that make each family's
# departures from Llama matter on 24 tokens: a window of 8, soft caps the scores and logits reach, a head_dim
# other than dim / heads, per-layer RoPE bases)
FAMILIES = {
    "llama-bias": ("LlamaConfig", {"attention_bias": True}),  # Llama with q/k/v/o biases (attention_bias)
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 16}),  # every layer slides
    "qwen2": ("Qwen2Config", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # per-head q/k RMSNorm, head_dim 32 != 64 / 4
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.5,
                                "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "tie_word_embeddings": True}),
}
FAMILY_BASE = {"hidden_size": 64, "intermediate_size": 128}

# Mixtures of experts: name -> (config class, overrides): 4 experts, top-2, each departure on (Qwen2-MoE's gated
# shared expert, un-normalised top-k scores and a dense layer among the MoE ones; Qwen3-MoE's q/k norms and
# renormalised scores), router_aux_loss_coef high enough that the aux loss moves the loss past the tolerance
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "router_aux_loss_coef": 0.1}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                                     "mlp_only_layers": [1], "router_aux_loss_coef": 0.1}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "head_dim": 32, "router_aux_loss_coef": 0.1}),
}


def config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_base(), **overrides})


def _base() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)


def family_config(family: str, **overrides):
    """The tiny config of a family (FAMILIES), made by its own transformers config class."""
    import transformers

    cls, extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    return getattr(transformers, cls)(**{**_base(), **FAMILY_BASE, **extra, **overrides})


def make_tokenizer(vocab: int = VOCAB):
    """A byte-level BPE of `vocab` tokens trained on the pydoc corpus (a second or so)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kiln.trainer.data.loader import pydoc_bytes

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([pydoc_bytes().decode()[:200_000]], trainer)
    return tok


def save_eos_tokenizer(path: Path) -> Path:
    """make_tokenizer() with an `<eos>` special token (kiln data prepare --eos), saved as tokenizer.json at `path`."""
    tok = make_tokenizer()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path))
    return path


def save_model(folder: Path, variant: str = "gqa", *, seed: int = 0, tokenizer=True, config_overrides=None,
               **save_kwargs):
    """A random model saved to folder (with tokenizer.json unless tokenizer=False): a LlamaForCausalLM of
    `variant` (VARIANTS), or the *ForCausalLM of a family (FAMILIES), made by transformers'
    AutoModelForCausalLM from the config (eager attention: transformers' reference implementation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    overrides = config_overrides or {}
    family = variant in FAMILIES or variant in MOE_FAMILIES
    cfg = family_config(variant, **overrides) if family else config(**VARIANTS[variant], **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():  # transformers initialises norms to 1 (Gemma's to 0) and biases to 0: random ones
        for name, p in model.named_parameters():  # test the mapping of every tensor
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.2, 0.2)
            elif name.endswith("gate.weight") and "layers" in name:  # routers: decisive, unequal top-k scores
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder, **save_kwargs)
    if tokenizer:
        make_tokenizer().save(str(folder / "tokenizer.json"))
    return model
