"""Hugging Face model folders in: `model.from` and `data.tokenizer` (out: kiln.trainer.model.hf_export).

In: the folder's config.json gives the dimensions (kiln.api.hf); the weights are read **streamed and sharded**:
every rank reads, for each parameter it holds (its FSDP/TP shard of the blocks of its pipeline stage), only the
byte range of that slice from the safetensors file, through the object store (file:// or s3://, ranged reads).
No rank ever holds a tensor it does not own, let alone the whole model. The safetensors format is an 8-byte
length, a JSON header and raw little-endian data; `safetensors.safe_open` needs a local file, so the header is
parsed here and the data read by range (tests check it against safetensors itself).

Names: kiln's parameters map one to one onto transformers' names (kiln.trainer.model.hf_names `NAME_MAP`, the
same for every family kiln reads but Gemma's extra norms; re-exported here). Both use the rotate-half
RoPE convention (transformers' conversion script permutes Meta's interleaved q/k rows once, into the layout
kiln uses too), so q/k weights are copied as they are; a test checks logits against transformers itself.
Tied embeddings are untied: the output layer starts as a copy of the embedding and trains on its own; an
export writes both, with tie_word_embeddings false.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from kiln.api import ModelDims, resolve_model
from kiln.api.hf import dims_from_config
from kiln.api.spec import TrainingSpecSpec
from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.bounded import parse_json, read_bytes, read_json_object
from kiln.storage.store import ObjectNotFound
from kiln.trainer.data.tokenizer import load_tokenizer, vocab_size  # noqa: F401 - torch-free home, names kept here
from kiln.trainer.model.hf_names import (  # noqa: F401  (the names reading does not use are re-exported)
    CONFIG, DTYPE_NAMES, DTYPES, GENERATION_CONFIG, INDEX, NAME_MAP, SANDWICH_NAMES, SINGLE, TOKENIZER_FILES, hf_name,
    hf_names, hf_shapes, experts_of,
)


MAX_HEADER = 100 << 20  # a safetensors header larger than this is corrupt (the format's own limit)
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # a buffer old conversions saved


def storage_endpoint(spec: TrainingSpecSpec) -> str | None:
    """The S3 endpoint for model.from and the tokenizer: the one data and checkpoints use."""
    return os.environ.get("KILN_DATA_ENDPOINT") or spec.checkpoint.endpoint


def open_folder(uri: str, endpoint: str | None, what: str) -> ObjectStore:
    try:
        return open_store(uri, endpoint=endpoint)
    except KilnError as err:
        raise KilnError(f"{what} {uri}: {err}") from None


def folder_json(store: ObjectStore, key: str, what: str) -> dict:
    try:
        return read_json_object(store, key, what=what)
    except ObjectNotFound:
        raise KilnError(f"{what}: no {key} in {store.uri}") from None


def read_config(uri: str, endpoint: str | None = None) -> dict:
    return folder_json(open_folder(uri, endpoint, "model.from"), CONFIG, f"model.from {uri}")


def resolve_dims(spec: TrainingSpecSpec, *, endpoint: str | None = None, config: dict | None = None) -> ModelDims:
    """The model's dimensions: from the preset and explicit fields, or from model.from's config.json (read
    here unless given). KilnError naming the field or the config key."""
    try:
        if spec.model.from_ is None:
            return resolve_model(spec.model)
        if config is None:
            config = read_config(spec.model.from_, endpoint or storage_endpoint(spec))
        return dims_from_config(config, spec.model, spec.model.from_)
    except ValueError as err:
        raise KilnError(f"spec.{err}") from None


@dataclass(frozen=True)
class TensorEntry:
    file: str  # key in the store
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file


def read_header(store: ObjectStore, key: str) -> dict[str, TensorEntry]:
    """The tensors one safetensors file holds; KilnError naming the file (and tensor) when it is truncated or
    its header is not what the format says."""
    where = store.url(key)
    try:
        size = store.size(key)
    except ObjectNotFound:
        raise KilnError(f"model.from: {where} is missing (named by {INDEX})") from None
    if size < 8:
        raise KilnError(f"model.from: {where} is truncated ({size} bytes; a safetensors file starts with an "
                        f"8-byte header length)")
    (n,) = struct.unpack("<Q", store.get_bytes(key, 0, 8))
    if n > min(MAX_HEADER, size - 8):
        raise KilnError(f"model.from: {where} has a corrupt or truncated safetensors header (length {n}, file "
                        f"{size} bytes)")
    try:
        header = parse_json(store.get_bytes(key, 8, n), where)
    except KilnError:
        header = None
    if not isinstance(header, dict):
        raise KilnError(f"model.from: {where} has a corrupt safetensors header (not a JSON object)")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise KilnError(f"model.from: {where}: tensor {name}: dtype {info.get('dtype') if isinstance(info, dict) else info!r} "
                            f"is not supported or its header entry is malformed (kiln reads F32, F16, BF16, F64)") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise KilnError(f"model.from: {where}: tensor {name}: data_offsets {begin}..{end} do not hold "
                            f"{list(shape)} {info['dtype']} ({nbytes} bytes); the file is corrupt")
        if base + end > size:
            raise KilnError(f"model.from: {where} is truncated: tensor {name} ends at byte {base + end}, the file "
                            f"has {size}")
        out[name] = TensorEntry(key, dtype, shape, base + begin)
    return out


def read_slice(store: ObjectStore, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """entry[offsets : offsets + sizes] (1-D or 2-D), reading only the rows it spans."""
    item = entry.dtype.itemsize
    row = math.prod(entry.shape[1:]) * item  # bytes per index of dim 0
    raw = store.get_bytes(entry.file, entry.start + offsets[0] * row, sizes[0] * row) if sizes[0] else b""
    if not raw:
        return torch.empty(sizes, dtype=entry.dtype)
    t = torch.frombuffer(bytearray(raw), dtype=entry.dtype)  # a writable copy: torch warns on read-only bytes
    t = t.view(sizes[0], *entry.shape[1:])
    if len(sizes) == 2:
        t = t[:, offsets[1]:offsets[1] + sizes[1]]
    return t


class Checkpoint:
    """The tensors of a Hugging Face model folder (one file or sharded with an index), headers read."""

    def __init__(self, uri: str, endpoint: str | None = None):
        self.uri = uri
        self.store = open_folder(uri, endpoint, "model.from")
        if self.store.exists(INDEX):
            index = folder_json(self.store, INDEX, f"model.from {uri}")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise KilnError(f"model.from {uri}: {INDEX} has no weight_map of tensor names to file names")
            files = sorted(set(weight_map.values()))
        elif self.store.exists(SINGLE):
            weight_map, files = None, [SINGLE]
        else:
            raise KilnError(f"model.from {uri}: neither {SINGLE} nor {INDEX} in the folder (kiln reads safetensors "
                            f"only; convert *.bin / *.pth with transformers' save_pretrained)")
        self.tensors: dict[str, TensorEntry] = {}
        for key in files:
            for name, entry in read_header(self.store, key).items():
                if weight_map is not None and weight_map.get(name) != key:
                    continue  # the index decides which file holds a tensor
                self.tensors[name] = entry
        if weight_map is not None:
            lost = sorted(n for n in weight_map if n not in self.tensors)
            if lost:
                raise KilnError(f"model.from {uri}: tensor {lost[0]} is listed in {INDEX} under "
                                f"{weight_map[lost[0]]} but that file does not hold it")

    def check(self, dims: ModelDims, tied: bool) -> None:
        """Every tensor the model needs is there with its shape, and nothing else is."""
        expected = hf_shapes(dims)
        present = {n for n in self.tensors if not IGNORED.match(n)}
        optional = {"lm_head.weight"} if tied else set()
        missing = sorted(set(expected) - present - optional)
        if missing:
            raise KilnError(f"model.from {self.uri}: tensor {missing[0]} is missing"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + ("" if tied or missing[0] != "lm_head.weight" else
                               "; a model with tied embeddings says tie_word_embeddings: true in config.json"))
        extra = sorted(present - set(expected))
        if extra:
            raise KilnError(f"model.from {self.uri}: tensor {extra[0]} is not part of a {dims.arch.family} model "
                            f"with this config.json" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        for name, shape in expected.items():
            entry = self.tensors.get(name)
            if entry is not None and entry.shape != shape:
                raise KilnError(f"model.from {self.uri}: tensor {name} has shape {list(entry.shape)}, config.json "
                                f"needs {list(shape)}")

    def sources_of(self, kiln_name: str, tied: bool, dims: ModelDims) -> list[TensorEntry]:
        """The tensors a kiln parameter is read from: one, or one per expert for stacked experts."""
        names = hf_names(kiln_name, dims.arch, experts_of(dims))
        if names == ["lm_head.weight"] and tied and names[0] not in self.tensors:
            names = ["model.embed_tokens.weight"]  # untied on import: the output layer starts as the embedding
        return [self.tensors[n] for n in names]


def _local_chunk(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global offsets, sizes) of the part of `param` this rank holds (all of a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        # The chunk DCP itself saves for this rank: right for FSDP2, TP and both together (strided shards).
        chunks = param.__create_chunk_list__()
        local = param.to_local()
        if not chunks:
            return local, (0,) * param.dim(), (0,) * param.dim()
        (chunk,) = chunks
        return local, tuple(chunk.offsets), tuple(chunk.sizes)
    return param, (0,) * param.dim(), tuple(param.shape)


@torch.no_grad()
def load_weights(model: nn.Module, uri: str, dims: ModelDims, *, endpoint: str | None = None,
                 config: dict | None = None, threads: int = 8) -> int:
    """Copy the model folder's weights into `model` (plain, or split/sharded by kiln.trainer.parallel.parallelize): each
    rank reads only its own slices. Returns the bytes this rank read."""
    config = config if config is not None else read_config(uri, endpoint)
    tied = bool(config.get("tie_word_embeddings", False))
    ckpt = Checkpoint(uri, endpoint)
    ckpt.check(dims, tied)
    from kiln.trainer.model.lora import is_adapter

    jobs = []
    for name, param in model.named_parameters():
        if is_adapter(name):  # LoRA adapters are not in the folder (kiln.trainer.model.lora.init_adapters)
            continue
        local, offsets, sizes = _local_chunk(param)
        jobs.append((local, ckpt.sources_of(name, tied, dims), offsets, sizes))
    read = 0
    window: deque = deque()  # reads in flight: at most 2 x threads slices are held in memory at once

    def finish() -> None:
        nonlocal read
        (local, entries, _, sizes), future = window.popleft()
        data = future.result()
        if math.prod(sizes):
            local.copy_(data.reshape(local.shape))
        read += data.numel() * entries[0].dtype.itemsize

    with ThreadPoolExecutor(threads, thread_name_prefix="kiln-hf-load") as pool:
        for job in jobs:
            window.append((job, pool.submit(_read_chunk, ckpt.store, job[1], job[2], job[3])))
            if len(window) >= 2 * threads:
                finish()
        while window:
            finish()
    return read


def _read_chunk(store: ObjectStore, entries: list[TensorEntry], offsets: tuple[int, ...],
                sizes: tuple[int, ...]) -> torch.Tensor:
    """A parameter's chunk: a slice of its one tensor, or for stacked experts (offsets and sizes over
    (experts, out, in)) the slices of the experts in its range, each read from its own tensor, stacked."""
    if len(entries) == 1:
        return read_slice(store, entries[0], offsets, sizes)
    first = offsets[0]
    parts = [read_slice(store, entries[e], offsets[1:], sizes[1:]) for e in range(first, first + sizes[0])]
    return torch.stack(parts) if parts else torch.empty(sizes, dtype=entries[0].dtype)


def tokenizer_uri(spec: TrainingSpecSpec) -> str:
    """data.tokenizer, else model.from's tokenizer, else the byte tokenizer."""
    return spec.data.tokenizer or spec.model.from_ or "byte"


def check_tokenizer(tokenizer, uri: str, dims: ModelDims) -> None:
    n = vocab_size(tokenizer)
    if n > dims.vocab_size:
        raise KilnError(f"data.tokenizer {uri}: its vocabulary has {n} tokens, more than the model's vocabSize "
                        f"{dims.vocab_size}; token ids past {dims.vocab_size - 1} would have no embedding")


def training_tokenizer(spec: TrainingSpecSpec, dims: ModelDims):
    """The run's tokenizer (None: bytes), checked against the model's vocabulary (and, for data.format chat, for
    a chat template)."""
    uri = tokenizer_uri(spec)
    tokenizer = load_tokenizer(uri, storage_endpoint(spec))
    check_tokenizer(tokenizer, uri, dims)
    if spec.data.format == "chat":  # the conversations were rendered with its template: it must have one that compiles
        from kiln.trainer.data.chat import ChatRenderer, load_chat_template

        ChatRenderer(load_chat_template(uri, storage_endpoint(spec)))
    return tokenizer
