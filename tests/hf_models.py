"""Small random Llama models made by transformers itself (not by kiln), saved as Hugging Face folders.

The reference side of kiln's import/export tests: `LlamaConfig` + `LlamaForCausalLM` + `save_pretrained`, and
a byte-level BPE tokenizer trained with the `tokenizers` library on the built-in corpus.
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


def config(**overrides):
    from transformers import LlamaConfig

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **overrides})


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


def save_model(folder: Path, variant: str = "gqa", *, seed: int = 0, tokenizer=True, **save_kwargs):
    """A random LlamaForCausalLM of `variant` saved to folder (with tokenizer.json unless tokenizer=False)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(**VARIANTS[variant])).eval()
    with torch.no_grad():  # transformers initialises norms to 1: random ones test the mapping of every tensor
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **save_kwargs)
    if tokenizer:
        make_tokenizer().save(str(folder / "tokenizer.json"))
    return model
