"""Deterministic, resumable data: the token sources and the global-batch loader.

A source is a list of fixed-length samples (seq_len + 1 tokens: inputs and shifted targets). The order of
samples is a pure function of (seed, sample index): epoch e visits the samples in the permutation
`randperm(n, seed + e)`. The loader's cursor is the number of samples the whole job has consumed, so the
same run, resumed at any step with any number of data-parallel ranks, sees the same sequences in each
global batch. Each rank takes its contiguous slice of every global batch.

Sources:
- `builtin:pydoc`: the English help text that ships with CPython (`pydoc_data.topics`, ~465 KB),
  byte-tokenized (vocab 256), or tokenized with data.tokenizer when it names one; the last 10 % is the
  validation split. No download.
- `synthetic`: uniformly random tokens, for throughput measurements.
- `file:///dir/` (or a plain path): tokenized shards `*.npy` (1-D integer arrays) or `*.bin` (raw
  little-endian uint16, nanoGPT style), read through memory maps in file-name order. With data.format chat,
  each `tokens-N.npy` has a `mask-N.npy` (kiln data prepare --format chat): targets outside the assistant's
  turns become IGNORE, which the loss skips (kiln.trainer.model.loss). Conversations are packed back to back into
  the windows, like documents (attention is not masked at their boundaries), unless data.packing is on: then each
  sample is a row of whole documents or conversations that attend only within themselves (kiln.trainer.data.packing),
  by the document starts kiln data prepare writes beside each shard (docs-N.idx).
- `data.sources`: several of the above mixed in fixed proportions (MixedSamples).
- `s3://bucket/prefix/`: the same shards in an object store (kiln.storage; keys from AWS_ACCESS_KEY_ID /
  AWS_SECRET_ACCESS_KEY, endpoint from KILN_DATA_ENDPOINT, else the checkpoint endpoint, else
  AWS_ENDPOINT_URL). Each shard is downloaded once into a local cache (KILN_DATA_CACHE, default
  ~/.cache/kiln/data) and then memory-mapped like a local one.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from kiln.api import contract
from kiln.errors import KilnError
from kiln.trainer.model.loss import IGNORE
from kiln.trainer.data.packing import PackedSamples, document_starts
from kiln.trainer.data.shards import DOCS_SUFFIX, MASK_PREFIX, TOKENS_PREFIX

VALIDATION_FRACTION = 0.1


def pydoc_bytes() -> bytes:
    """The built-in corpus: every pydoc topic, in sorted order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class TokenSamples:
    """Non-overlapping windows of seq_len + 1 tokens over one or more token arrays; with `masks` (chat data, one
    byte per token, 1: the assistant's) each window also has a loss mask (`target_mask`)."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int, vocab_size: int,
                 masks: list[np.ndarray] | None = None):
        self.arrays, self.seq_len, self.masks = arrays, seq_len, masks
        self.masked = masks is not None
        counts = [max(0, (len(a) - 1) // seq_len) for a in arrays]
        self.starts = np.cumsum([0] + counts).tolist()
        if self.starts[-1] == 0:
            raise KilnError(f"data: fewer than seq_len + 1 = {seq_len + 1} tokens; use a shorter model.seqLen")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.starts[-1]

    def _window(self, arrays: list[np.ndarray], index: int) -> np.ndarray:
        shard = bisect.bisect_right(self.starts, index) - 1
        offset = (index - self.starts[shard]) * self.seq_len
        return arrays[shard][offset : offset + self.seq_len + 1]

    def get(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self._window(self.arrays, index), dtype=np.int64))

    def target_mask(self, index: int) -> torch.Tensor:
        """Which of the window's seq_len targets (its tokens 1..seq_len) carry loss."""
        return torch.from_numpy(np.asarray(self._window(self.masks, index)[1:], dtype=np.bool_))


class SyntheticSamples:
    """Random tokens; sample i is a pure function of (seed, i)."""

    ordered = True  # already random: a permutation of 2^30 would be wasted work

    def __init__(self, seq_len: int, vocab_size: int, seed: int, size: int = 1 << 30):
        self.seq_len, self.vocab_size, self.seed, self.size = seq_len, vocab_size, seed, size

    def __len__(self) -> int:
        return self.size

    def get(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)


def fetch_shards(uri: str, *, endpoint: str | None = None, cache_root: str | None = None) -> Path:
    """Download the *.npy / *.bin shards under an s3:// uri into a local cache folder (once); its path.

    The ranks of a node share the cache: one downloads (a file lock) while the others wait; a shard already
    present is not fetched again. Shards that cannot fit are refused before any download (check_cache_room).
    """
    from kiln.storage import open_store

    store = open_store(uri, endpoint=endpoint)
    root = Path(cache_root or os.environ.get(contract.DATA_CACHE) or Path.home() / ".cache" / "kiln" / "data")
    folder = root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    shards = [info for info in store.list("")
              if Path(info.key).suffix in (".npy", ".bin", DOCS_SUFFIX) and "/" not in info.key.strip("/")]
    # One downloader per node and cache: the other ranks wait on the lock, then find every shard in place
    # (one copy on the disk, not one per rank).
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [info for info in shards
                   if not ((folder / Path(info.key).name).exists()
                           and (folder / Path(info.key).name).stat().st_size == info.size)]
        check_cache_room(uri, root, sum(info.size for info in missing))
        for info in missing:
            name = Path(info.key).name
            tmp = folder / f".{name}.{os.getpid()}.part"
            store.get_file(info.key, tmp)
            os.replace(tmp, folder / name)  # atomic: a reader never sees half a shard
    return folder


def check_cache_room(uri: str, root: Path, needed: int) -> None:
    """Refuse, before downloading anything, shards that cannot fit: in the pod's disk budget (the operator
    sets KILN_DATA_CACHE_BYTES to its ephemeral-storage limit, past which the kubelet would evict the pod
    mid-download and every restart would start over) or on the disk itself."""
    if needed <= 0:
        return
    budget = os.environ.get(contract.DATA_CACHE_BYTES)
    if budget:
        used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        if used + needed > int(budget):
            raise KilnError(f"data.uri {uri}: its shards need {needed / 2**30:.1f} GiB more in the pod's data cache, "
                            f"which holds {used / 2**30:.1f} GiB of {int(budget) / 2**30:.1f} GiB "
                            "(resources.ephemeralStorage); raise resources.ephemeralStorage")
    free = shutil.disk_usage(root).free
    if needed > free:
        raise KilnError(f"data.uri {uri}: its shards need {needed / 2**30:.1f} GiB in the data cache {root}, "
                        f"which has {free / 2**30:.1f} GiB free")


def open_source(uri: str, *, seq_len: int, vocab_size: int, seed: int, split: str = "train",
                endpoint: str | None = None, tokenizer=None, chat: bool = False, packing: bool = False):
    """The samples behind a data.uri; KilnError names the uri and what is accepted. `tokenizer` (a
    `tokenizers.Tokenizer`, None for bytes) tokenizes the built-in corpus; token shards are already tokenized.
    chat: the shards' loss masks too (data.format chat), which `kiln data prepare --format chat` writes.
    packing: rows of whole documents (data.packing), by the document starts kiln data prepare writes."""
    if chat and not uri.startswith(("file://", "s3://", "/")):
        raise KilnError(f"data.uri {uri}: data.format chat trains on conversations prepared with kiln data prepare "
                        "--format chat; use file:///path/ or s3://bucket/prefix/ to them")
    if packing and not uri.startswith(("file://", "s3://", "/")):
        raise KilnError(f"data.uri {uri}: data.packing packs the documents of shards prepared with kiln data prepare; "
                        "use file:///path/ or s3://bucket/prefix/ to them")
    if uri == "synthetic":
        return SyntheticSamples(seq_len, vocab_size, seed + (0 if split == "train" else 1))
    if uri == "builtin:pydoc":
        if tokenizer is not None:
            ids = tokenizer.encode(pydoc_bytes().decode("utf-8"), add_special_tokens=False).ids
            tokens = np.asarray(ids, dtype=np.int64)
        elif vocab_size < 256:
            raise KilnError(f"data.uri builtin:pydoc is byte-tokenized and needs model.vocabSize >= 256, not {vocab_size}")
        else:
            tokens = np.frombuffer(pydoc_bytes(), dtype=np.uint8)
        cut = int(len(tokens) * (1 - VALIDATION_FRACTION))
        return TokenSamples([tokens[:cut] if split == "train" else tokens[cut:]], seq_len, vocab_size)
    if uri.startswith("s3://"):
        path = fetch_shards(uri, endpoint=endpoint)
    else:
        path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise KilnError(f"data.uri {uri}: no such folder; use 'synthetic', 'builtin:pydoc' or file:///path/ to tokenized shards")
    files = sorted(p for p in path.iterdir()
                   if p.suffix in (".npy", ".bin") and not p.name.startswith(MASK_PREFIX))
    if not files:
        raise KilnError(f"data.uri {uri}: no *.npy or *.bin token shards in {path}")
    arrays = [np.load(f, mmap_mode="r") if f.suffix == ".npy" else np.memmap(f, dtype="<u2", mode="r") for f in files]
    masks = _masks(uri, files, arrays) if chat else None
    if packing:
        return PackedSamples(arrays, document_starts(uri, files, [len(a) for a in arrays]), seq_len, seed,
                             masks=masks, uri=uri, names=[f.name for f in files])
    return TokenSamples(arrays, seq_len, vocab_size, masks)


def _masks(uri: str, files: list[Path], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The loss mask beside each token shard (tokens-N.npy → mask-N.npy), one byte per token."""
    masks = []
    for f, tokens in zip(files, arrays):
        mask_file = f.with_name(MASK_PREFIX + f.name.removeprefix(TOKENS_PREFIX))
        if not mask_file.exists():
            raise KilnError(f"data.uri {uri}: {f.name} has no {mask_file.name}: data.format chat needs shards "
                            "prepared with kiln data prepare --format chat (their loss masks)")
        mask = np.load(mask_file, mmap_mode="r")
        if mask.shape != tokens.shape:
            raise KilnError(f"data.uri {uri}: {mask_file.name} has {len(mask)} entries for {len(tokens)} tokens in "
                            f"{f.name}; prepare the folder again")
        masks.append(mask)
    return masks


def open_data(data, *, seq_len: int, vocab_size: int, seed: int, endpoint: str | None = None, tokenizer=None):
    """The training samples of a spec's `data` (kiln.api.DataSpec): data.uri's source, or the mix of
    data.sources. Each mixed source gets its own seed, so two sources of the same kind differ."""
    chat, packing = data.format == "chat", data.packing
    if not data.sources:
        return open_source(data.uri, seq_len=seq_len, vocab_size=vocab_size, seed=seed, endpoint=endpoint,
                           tokenizer=tokenizer, chat=chat, packing=packing)
    opened = []
    for k, src in enumerate(data.sources):
        try:
            opened.append(open_source(src.uri, seq_len=seq_len, vocab_size=vocab_size, seed=seed + 104729 * (k + 1),
                                      endpoint=endpoint, tokenizer=tokenizer, chat=chat, packing=packing))
        except KilnError as err:
            raise KilnError(f"data.sources[{k}]: {err}") from None
    return MixedSamples(opened, [src.weight for src in data.sources], [src.uri for src in data.sources], seed)


class SeededOrder:
    """The visiting order of n samples: epoch e is `randperm(n, seed + e)`; a pure function of the index."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def __call__(self, index: int) -> int:
        epoch = index // self.n
        if epoch != self._epoch:
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            self._epoch = epoch
        return int(self._perm[index % self.n])


MIX_BLOCK = 1000  # samples per mixing block: realised proportions are exact to 1/MIX_BLOCK at block ends


def block_counts(weights: list[float], block: int = MIX_BLOCK) -> list[int]:
    """Samples of each source in one block of `block`: the weights' shares, rounded by largest remainder so
    they sum to `block`. A source with a weight too small for one sample per block is refused."""
    total = sum(weights)
    exact = [block * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: block - sum(counts)]:
        counts[i] += 1
    return counts


class MixedSamples:
    """Several sources drawn in fixed proportions, deterministically: a pure function of (seed, index).

    The global sample stream is cut into blocks of MIX_BLOCK; block b holds `block_counts(weights)[k]`
    samples of source k, at positions shuffled by (seed, b). The j-th sample of source k that the mix asks
    for is that source's own j-th sample in its seeded order (SeededOrder), so each source is read without
    repeats until it is exhausted, then in a new order. The loader's cursor (samples consumed) is all the
    state there is: a resumed run, at any world size, draws the same samples.
    """

    ordered = True  # the loader must not permute the mix: it orders itself

    def __init__(self, sources: list, weights: list[float], names: list[str], seed: int):
        self.sources, self.names, self.seed = sources, names, seed
        self.counts = block_counts(weights)
        if 0 in self.counts:
            small = [n for n, c in zip(names, self.counts) if c == 0]
            raise KilnError(f"data.sources: {', '.join(small)} weigh less than 1/{MIX_BLOCK} of the mix; raise "
                            "their weight or drop them")
        self.orders = [SeededOrder(len(s), seed + 7919 * (k + 1)) for k, s in enumerate(sources)]
        self.seq_len = sources[0].seq_len
        self.masked = all(getattr(s, "masked", False) for s in sources)  # data.format chat: all of them
        self.packed = all(getattr(s, "packed", False) for s in sources)  # data.packing: all of them
        self._block, self._layout = -1, None

    def __len__(self) -> int:
        return 1 << 62  # endless: every source wraps around into a new epoch of its own

    def _positions(self, block: int) -> tuple[list[int], list[int]]:
        """For each position of `block`: its source, and how many of that source's samples precede it."""
        if block != self._block:
            kinds = torch.tensor([k for k, c in enumerate(self.counts) for _ in range(c)])
            kinds = kinds[torch.randperm(MIX_BLOCK, generator=torch.Generator().manual_seed(self.seed * 31 + block))]
            seen, before = [0] * len(self.counts), []
            for k in kinds.tolist():
                before.append(seen[k])
                seen[k] += 1
            self._block, self._layout = block, (kinds.tolist(), before)
        return self._layout

    def source_of(self, index: int) -> tuple[int, int]:
        """(source, that source's sample number) of global sample `index`."""
        block, pos = divmod(index, MIX_BLOCK)
        kinds, before = self._positions(block)
        k = kinds[pos]
        return k, block * self.counts[k] + before[pos]

    def get(self, index: int) -> torch.Tensor:
        k, j = self.source_of(index)
        return self.sources[k].get(self.orders[k](j))

    def target_mask(self, index: int) -> torch.Tensor:
        k, j = self.source_of(index)
        return self.sources[k].target_mask(self.orders[k](j))

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, j = self.source_of(index)
        return self.sources[k].row(self.orders[k](j))

    def drawn(self, samples: int) -> dict[str, int]:
        """How many of the first `samples` samples came from each source (the realised mix)."""
        block, rest = divmod(samples, MIX_BLOCK)
        out = [block * c for c in self.counts]
        if rest:
            kinds, _ = self._positions(block)
            for k in kinds[:rest]:
                out[k] += 1
        return dict(zip(self.names, out))


class GlobalBatchLoader:
    """Global batches of samples in a seeded order, sliced for this data-parallel rank; resumable."""

    def __init__(self, source, *, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.source, self.seed, self.dp_rank, self.dp_size = source, seed, dp_rank, dp_size
        self.samples_seen = 0  # the cursor: samples consumed by the whole job
        # random tokens need no order, and a mix orders itself
        self._order = None if getattr(source, "ordered", False) else SeededOrder(len(source), seed)

    def _sample_id(self, index: int) -> int:
        return index if self._order is None else self._order(index)

    def mix(self) -> dict[str, float] | None:
        """The realised share of each source in the samples consumed so far (None: one source)."""
        if not isinstance(self.source, MixedSamples) or self.samples_seen == 0:
            return None
        drawn = self.source.drawn(self.samples_seen)
        return {name: count / self.samples_seen for name, count in drawn.items()}

    @property
    def packed(self) -> bool:
        """Whether rows are packed documents with doc_ids (data.packing)."""
        return getattr(self.source, "packed", False)

    @property
    def masked(self) -> bool:
        """Whether targets carry IGNORE where no loss is taken (data.format chat)."""
        return getattr(self.source, "masked", False)

    def rows(self, first: int, count: int) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) of `count` samples from position `first` of the global order, each (count, seq_len);
        a target that carries no loss (chat data: not the assistant's) is IGNORE. Packed rows (data.packing) add
        their doc_ids, which the model's attention keeps apart."""
        ids = [self._sample_id(first + i) for i in range(count)]
        if self.packed:
            return tuple(torch.stack(parts) for parts in zip(*(self.source.row(i) for i in ids)))
        rows = torch.stack([self.source.get(i) for i in ids])
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if self.masked:
            keep = torch.stack([self.source.target_mask(i) for i in ids])
            targets = targets.masked_fill_(~keep, IGNORE)
        return inputs, targets

    def next_batch(self, global_batch: int) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) (packed: and doc_ids), each (global_batch // dp_size, seq_len), and advance the cursor."""
        per_rank = global_batch // self.dp_size
        batch = self.rows(self.samples_seen + self.dp_rank * per_rank, per_rank)
        self.samples_seen += global_batch
        return batch

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise KilnError(f"checkpoint data seed {state['seed']} differs from training.seed {self.seed}")
        self.samples_seen = int(state["samples_seen"])
