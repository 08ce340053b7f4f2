"""Import, batches and export-and-reload of a Hugging Face family model, shared by the dense and MoE family
tests (tests/unit/test_model_families.py, test_moe_families.py): transformers is the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.api.hf import config_for
from kiln.api.load import parse
from kiln.storage import open_store
from kiln.trainer.model import hf_export, hf_folder as hf
from kiln.trainer.model.transformer import build_model
from tests.hf_models import VOCAB

SEQ = 24  # past every tiny family's sliding window (8), so the window is exercised
STEPS = 3



def imported(folder: Path) -> tuple[torch.nn.Module, dict]:
    spec = parse({"spec": {"model": {"from": f"file://{folder}", "seqLen": 32}}}).spec
    dims = hf.resolve_dims(spec)
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_buffers()
    hf.load_weights(model, f"file://{folder}", dims)
    return model, json.loads((folder / "config.json").read_text())


def batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen) for _ in range(n)]


def exported(model: torch.nn.Module, base: dict, out: Path):
    """kiln's export of `model` (config.json from `base`, the imported folder's) reloaded by transformers'
    AutoModelForCausalLM, which found every tensor it expects and no other."""
    from transformers import AutoModelForCausalLM

    hf_export.write_folder(hf_export.hf_state(model, torch.float32), open_store(f"file://{out}"),
                           config=config_for(model.dims, base=base), generation={}, tokenizer_files={},
                           max_shard_bytes=1 << 30)
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return reloaded


def step(*pairs) -> None:
    """One optimizer step of kiln's model and of the reference, each from its own loss: (optimizer, loss) pairs."""
    for optimizer, loss in pairs:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
