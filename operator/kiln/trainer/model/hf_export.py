"""`kiln export --format hf`: one process loads the newest commit (any world size; DCP reshards) and writes a
Hugging Face folder: sharded safetensors, the index, config.json, generation_config.json and the tokenizer files.
Tied embeddings were untied in training, so an export writes both, with tie_word_embeddings false.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.api.hf import config_for
from kiln.api.spec import TrainingSpecSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore
from kiln.storage.bounded import read_bytes
from kiln.trainer.model.hf_folder import (folder_json, open_folder, read_config, resolve_dims, storage_endpoint,
                                          tokenizer_uri)
from kiln.trainer.model.hf_names import (CONFIG, EXPERTS, GENERATION_CONFIG, INDEX, SINGLE, TOKENIZER_FILES, experts_of,
                                         hf_names)


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The transformers state dict of a plain (single-process) kiln model, in its family's names."""
    out = {}
    for n, p in model.named_parameters():
        names = hf_names(n, model.dims.arch, experts_of(model.dims))
        if EXPERTS.match(n):  # stacked experts: one tensor per expert, as transformers saves them
            out.update({name: p[e].detach().to(dtype).contiguous() for e, name in enumerate(names)})
        else:
            out[names[0]] = p.detach().to(dtype).contiguous()
    return out


def shard_plan(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into consecutive groups of at most max_bytes (a larger tensor gets a group alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def put_safetensors(store: ObjectStore, key: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file at `key`, serialised by the `safetensors` library straight to a file (never a copy
    of the shard in memory): in place under a temporary name on file:// (fsync'd, then renamed, like every
    FileStore write), else to a local temporary file that the store uploads (multipart on S3)."""
    from safetensors.torch import save_file

    local = store.local_path(key)
    if local is None:
        with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
            path = os.path.join(tmp, "shard.safetensors")
            save_file(tensors, path, metadata={"format": "pt"})
            store.put_file(key, path)
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def write_folder(state: dict[str, torch.Tensor], store: ObjectStore, *, config: dict, generation: dict,
                 tokenizer_files: dict[str, bytes], max_shard_bytes: int) -> list[str]:
    """A Hugging Face model folder in `store`: safetensors shards (+ index when more than one), the tokenizer
    files, generation_config.json, then config.json last (a folder without it is not a model: an interrupted
    export is never mistaken for a finished one). Returns the keys written."""
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    groups = shard_plan(sizes, max_shard_bytes)
    names = [SINGLE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    written = []
    for key, group in zip(names, groups):
        put_safetensors(store, key, {n: state[n] for n in group})
        written.append(key)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: key for key, group in zip(names, groups) for n in group}}
        store.put_bytes(INDEX, json.dumps(index, indent=2).encode())
        written.append(INDEX)
    for key, data in tokenizer_files.items():
        store.put_bytes(key, data)
        written.append(key)
    store.put_bytes(GENERATION_CONFIG, json.dumps(generation, indent=2).encode())
    store.put_bytes(CONFIG, json.dumps(config, indent=2).encode())
    return written + [GENERATION_CONFIG, CONFIG]


def tokenizer_files(uri: str, endpoint: str | None) -> dict[str, bytes]:
    """The tokenizer files to ship with an export: those of a model folder, or one tokenizer.json."""
    if uri == "byte":
        return {}
    if uri.rstrip("/").endswith(".json"):
        folder, key = uri.rstrip("/").rsplit("/", 1)
        store = open_folder(folder + "/", endpoint, "data.tokenizer")
        return {"tokenizer.json": read_bytes(store, key, kind="tokenizer.json", what=f"data.tokenizer {uri}")}
    store = open_folder(uri, endpoint, "data.tokenizer")
    return {name: read_bytes(store, name, what=f"data.tokenizer {uri}") for name in TOKENIZER_FILES
            if store.exists(name)}


@dataclass(frozen=True)
class ExportResult:
    step: int
    files: list[str]
    bytes: int
    output: str


def export_hf(doc, *, checkpoint_uri: str, output_uri: str, endpoint: str | None = None,
              dtype: str | None = None, max_shard_bytes: int = 2 << 30, merge: bool = False) -> ExportResult:
    """Load the newest commit under checkpoint_uri (saved at any world size) into this process and write it
    as a Hugging Face folder at output_uri. dtype defaults to model.from's (its config's torch_dtype/dtype),
    else float32 (kiln's master weights). merge: a LoRA run's adapters folded into its base (read from
    model.from, else the seed's), W + (alpha / rank) · B A, in fp32 before the cast to dtype."""
    from kiln.trainer.evaluate import initial_model, load_checkpoint
    from kiln.trainer.model.lora import merge_adapters
    from kiln.trainer.model.transformer import build_model

    spec = doc.spec
    if merge != (spec.model.adapter is not None):
        raise KilnError("--merge folds LoRA adapters into their base, and spec.model.adapter is not set: drop --merge"
                        if merge else "this run trains LoRA adapters (spec.model.adapter): its checkpoints hold "
                        "the adapters only; export them with --format peft, or the merged model with --merge")
    ep = endpoint or storage_endpoint(spec)
    base = read_config(spec.model.from_, ep) if spec.model.from_ else {}
    if dtype is None:  # the source folder's, when it names one kiln writes
        dtype = next((d for d in (base.get("torch_dtype"), base.get("dtype")) if d in EXPORT_DTYPES), "float32")
    if dtype not in EXPORT_DTYPES:
        raise KilnError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    dims = resolve_dims(spec, config=base or None)
    try:  # before any checkpoint is read: a model transformers has no family for is refused first
        config = config_for(dims, dtype=dtype, base=base)
    except ValueError as err:
        raise KilnError(f"spec.{err}") from None
    if merge:  # the base's weights, then the adapters from the commit
        model = initial_model(doc, dims, torch.device("cpu"), ep)
    else:  # every weight comes from the commit
        model = build_model(dims)
        model.to_empty(device="cpu")
        model.init_buffers()
    step = load_checkpoint(model, doc, checkpoint_uri, endpoint)
    if merge:
        merge_adapters(model)
    state = hf_state(model, EXPORT_DTYPES[dtype])
    del model
    tok_uri = tokenizer_uri(spec)
    tok_files = tokenizer_files(tok_uri, ep) if tok_uri != "byte" else {}
    generation = _generation_config(spec, ep, base)
    store = open_folder(output_uri, ep, "--output")
    files = write_folder(state, store, config=config, generation=generation, tokenizer_files=tok_files,
                         max_shard_bytes=max_shard_bytes)
    total = sum(store.size(k) for k in files)
    return ExportResult(step, files, total, output_uri)


def _generation_config(spec: TrainingSpecSpec, endpoint: str | None, base: dict) -> dict[str, Any]:
    """model.from's generation_config.json when it has one, else the token ids of its config."""
    if spec.model.from_:
        store = open_folder(spec.model.from_, endpoint, "model.from")
        if store.exists(GENERATION_CONFIG):
            return folder_json(store, GENERATION_CONFIG, f"model.from {spec.model.from_}")
    return {k: base.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if base.get(k) is not None}
