"""A chat model folder for the chat tests: the byte-level BPE of tests/hf_models.py with Llama 3's header and
end-of-turn special tokens, and a Llama-3-style chat template in tokenizer_config.json (the file transformers
reads), with or without `{% generation %}` blocks around the assistant's turns."""

from __future__ import annotations

import json
from pathlib import Path

from tests.hf_models import make_tokenizer

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

LLAMA3_STYLE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
WITHOUT_GENERATION = LLAMA3_STYLE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "user", "content": "What is a tuple?"},
     {"role": "assistant", "content": "An immutable sequence."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a loop statement."},
     {"role": "assistant", "content": "for"},
     {"role": "user", "content": "And another, caf\u00e9?"},
     {"role": "assistant", "content": "  while, with an else clause.  "}],
]


def save_chat_folder(folder: Path, template: str | None = LLAMA3_STYLE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def transformers_encoding(folder, conversation) -> tuple[list[int], list[int]]:
    """(input_ids, assistant_masks) as transformers computes them (it needs the {% generation %} template)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    out = tok.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])
