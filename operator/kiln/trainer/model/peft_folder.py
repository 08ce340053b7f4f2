"""LoRA runs in and out of storage: the base model's identity a commit carries, and `kiln export --format peft`.

The identity of a base is what the adapters were trained on: model.from's URI and a digest of its config.json
and weight index (every tensor's name, dtype, shape, file and offset, as the safetensors headers and the index
say), or, for a model initialised from training.seed, the seed and the dimensions. A commit of a LoRA run
holds it in trainer.json (`adapter.base`); a resume on another base is refused before any tensor is loaded
(kiln.trainer.model.lora.check_base).

The peft folder: `adapter_config.json` (peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules, the
base's URI) and `adapter_model.safetensors` with peft's keys, `base_model.model.<transformers path>.lora_A.weight`
(kiln's `<path>.lora_A.weight` through kiln.trainer.model.hf_names.NAME_MAP), which
`peft.PeftModel.from_pretrained(<the base, loaded by transformers>, folder)` loads.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from kiln.api import ModelDims
from kiln.api.presets import Arch
from kiln.api.spec import EXPERT_TARGETS, AdapterSpec, TrainingSpecSpec
from kiln.errors import KilnError
from kiln.trainer.model import hf_export, hf_folder as hf
from kiln.trainer.model.lora import arch_of, is_adapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def base_identity(spec: TrainingSpecSpec, dims: ModelDims, *, endpoint: str | None = None) -> dict:
    """{"uri", "digest"} of the model the adapters sit on (reads model.from's config.json and headers)."""
    h = hashlib.sha256()
    if spec.model.from_:
        uri = spec.model.from_
        store = hf.open_folder(uri, endpoint, "model.from")
        h.update(store.get_bytes(hf.CONFIG))
        for name, e in sorted(hf.Checkpoint(uri, endpoint).tensors.items()):
            h.update(f"{name} {e.dtype} {list(e.shape)} {e.file} {e.start}\n".encode())
    else:
        uri = f"seed:{spec.training.seed}"
        h.update(dims.model_dump_json().encode())
    return {"uri": uri, "digest": h.hexdigest()[:16]}


def adapter_record(spec: TrainingSpecSpec, dims: ModelDims, *, endpoint: str | None = None) -> dict | None:
    """What a LoRA run's trainer.json carries about its adapters (None for a full fine-tune)."""
    a = spec.model.adapter
    if a is None:
        return None
    return {"type": a.type, "rank": a.rank, "alpha": a.alpha, "targets": list(a.targets),
            "base": base_identity(spec, dims, endpoint=endpoint)}


def peft_name(kiln_name: str, arch: Arch = Arch()) -> str:
    """`layers.0.attention.wq.lora_A.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
    (a shared expert's path is the family's: Qwen2-MoE's `mlp.shared_expert.gate_proj`)."""
    path, _, key = kiln_name.rpartition(".lora_")
    return "base_model.model." + hf.hf_name(path + ".weight", arch).removesuffix(".weight") + ".lora_" + key


# kiln's routed-expert adapters (kiln.trainer.model.lora.LoRAExperts): layers.{i}.feed_forward.experts.<target>.lora_X
_EXPERT_ADAPTER = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)\.lora_([AB])\.weight$")


def peft_expert_entry(kiln_name: str, tensor: torch.Tensor, targets: list[str]) -> tuple[str, torch.Tensor] | None:
    """A routed-expert adapter under peft's key and layout, None for any other name. peft wraps each targeted
    parameter of `mlp.experts` (transformers' module name in every MoE family) in a ParamWrapper, in the order of
    `target_parameters`: with both targeted, the first (gate_up_proj) is the inner one, `base_layer`. Its A is
    (experts x rank, in) and its B (out, rank x experts), rank-major: kiln's stacked (experts, rank, in) A is that A
    reshaped, and kiln's (experts, out, rank) B is that B once its columns are put expert-minor."""
    m = _EXPERT_ADAPTER.match(kiln_name)
    if m is None:
        return None
    layer, target, which = m.groups()
    inner = "base_layer." if target == "gate_up_proj" and len(expert_targets(targets)) == 2 else ""
    t = tensor.detach().float()
    t = t.reshape(-1, t.shape[-1]) if which == "A" else t.permute(1, 2, 0).reshape(t.shape[1], -1)
    return f"base_model.model.model.layers.{layer}.mlp.experts.{inner}lora_{which}.weight", t.contiguous()


def expert_targets(targets: list[str]) -> list[str]:
    """peft's target_parameters for these targets, in kiln's order (gate_up_proj first): see peft_expert_entry."""
    return [f"mlp.{t}" for t in EXPERT_TARGETS if t in targets]


def peft_state(model: nn.Module, targets: list[str] = ()) -> dict[str, torch.Tensor]:
    """The adapters of a plain (single-process) model under peft's keys, fp32."""
    arch, out = arch_of(model), {}
    for n, p in model.named_parameters():
        if is_adapter(n):
            key, value = peft_expert_entry(n, p, list(targets)) or (peft_name(n, arch), p.detach().float().contiguous())
            out[key] = value
    return out


def peft_config(adapter: AdapterSpec, base_uri: str | None) -> dict:
    """peft's adapter_config.json for these adapters (a LoraConfig of a causal LM)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_uri,
            "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
            "target_modules": sorted(set(adapter.targets) - set(EXPERT_TARGETS)),
            "target_parameters": expert_targets(adapter.targets) or None, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None}


def write_adapter(store, model: nn.Module, adapter: AdapterSpec, base_uri: str | None) -> list[str]:
    """adapter_model.safetensors, then adapter_config.json last (a folder without it is not an adapter)."""
    hf_export.put_safetensors(store, ADAPTER_WEIGHTS, peft_state(model, adapter.targets))
    store.put_bytes(ADAPTER_CONFIG, json.dumps(peft_config(adapter, base_uri), indent=2).encode())
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


@dataclass(frozen=True)
class AdapterExport:
    step: int
    files: list[str]
    bytes: int
    output: str


def export_peft(doc, *, checkpoint_uri: str, output_uri: str, endpoint: str | None = None) -> AdapterExport:
    """The adapters of the newest commit under checkpoint_uri (any world size) as a peft adapter folder. The
    base's weights are not read: only its config.json (the dimensions) and the commit."""
    from kiln.trainer.evaluate import initial_model, load_checkpoint

    spec = doc.spec
    if spec.model.adapter is None:
        raise KilnError("--format peft exports LoRA adapters, and spec.model.adapter is not set; use --format hf")
    ep = endpoint or hf.storage_endpoint(spec)
    dims = hf.resolve_dims(spec, endpoint=ep)
    model = initial_model(doc, dims, torch.device("cpu"), ep, load_from=False)
    step = load_checkpoint(model, doc, checkpoint_uri, endpoint)
    store = hf.open_folder(output_uri, ep, "--output")
    files = write_adapter(store, model, spec.model.adapter, spec.model.from_)
    return AdapterExport(step, files, sum(store.size(k) for k in files), output_uri)
