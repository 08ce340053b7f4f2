"""`kiln data prepare`'s writing: token shards (uint16 when the vocabulary fits), their document offsets and
chat masks, progress.json while a run is unfinished (a rerun resumes after its finished shards) and the counts
that manifest.json holds."""

from __future__ import annotations

import bisect
import io
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import KilnError
from kiln.storage import ObjectStore
from kiln.storage.bounded import read_json_object
from kiln.storage.store import ObjectNotFound
from kiln.trainer.data.shards import DOCS_PREFIX, DOCS_SUFFIX, MASK_PREFIX, TOKENS_PREFIX


MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # an unfinished run's state (kiln.trainer.data.prepare.ShardWriter); gone once MANIFEST is there


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Prepared:
    documents_in: int = 0
    documents_out: int = 0
    tokens: int = 0
    removed: Counter = field(default_factory=Counter)
    shards: list[dict] = field(default_factory=list)


class ShardWriter:
    """Tokens appended document by document, cut into shards of exactly `shard_tokens` (the last one shorter).
    With `masked` (chat data), each token also has a loss-mask byte (1: an assistant token), written to
    mask-NNNNN.npy beside tokens-NNNNN.npy. docs-NNNNN.idx lists where in the shard each document starts (int64
    offsets; a document may run on into the next shard), which data.packing packs by. After each shard, PROGRESS
    records the shards so far, how many kept documents they (and the carried-over remainder) hold, and that
    remainder: an interrupted run resumes from there."""

    def __init__(self, store: ObjectStore, shard_tokens: int, dtype: np.dtype, result: Prepared, settings: dict,
                 masked: bool = False):
        self.store, self.shard_tokens, self.dtype, self.result = store, shard_tokens, dtype, result
        self.settings, self.masked = settings, masked
        self.pending: list[np.ndarray] = []
        self.pending_mask: list[np.ndarray] = []
        self.count = 0
        self.kept = 0  # kept documents whose tokens were all added
        self.starts: list[int] | None = []  # offsets in the pending tokens where documents start; None: not kept

    def _cut_starts(self, at: int) -> np.ndarray | None:
        """The document starts before token `at` of the pending tokens; the rest move to the remainder."""
        if self.starts is None:
            return None
        cut = bisect.bisect_left(self.starts, at)
        head, self.starts = self.starts[:cut], [s - at for s in self.starts[cut:]]
        return np.asarray(head, dtype=np.int64)

    def resume(self, progress: dict) -> None:
        carry = np.asarray(progress["carry"], dtype=self.dtype)
        self.pending, self.count, self.kept = [carry], len(carry), int(progress["kept_documents"])
        # a run interrupted before kiln kept document boundaries: its shards have none, nor will the rest
        self.starts = list(progress["carry_starts"]) if "carry_starts" in progress else None
        if self.masked:
            self.pending_mask = [np.asarray(progress["carry_mask"], dtype=np.uint8)]
        self.result.shards = list(progress["shards"])

    def add(self, docs: list[list[int]], masks: list[list[int]] | None = None) -> None:
        """The token ids of a batch of kept documents, in order (one array for all: no per-document overhead),
        and with `masked` their loss masks."""
        total = sum(len(d) for d in docs)
        if self.starts is not None:
            at = self.count
            for d in docs:
                if d:  # an empty document starts nothing
                    self.starts.append(at)
                at += len(d)
        self.pending.append(np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype, count=total))
        if self.masked:
            self.pending_mask.append(np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=total))
        self.count += total
        self.kept += len(docs)  # all of them are in the shards or the carried-over remainder from here on
        while self.count >= self.shard_tokens:
            flat = np.concatenate(self.pending)
            flat_mask = np.concatenate(self.pending_mask) if self.masked else None
            rest = flat[self.shard_tokens:]
            rest_mask = flat_mask[self.shard_tokens:] if self.masked else None
            self._write(flat[:self.shard_tokens], rest,
                        flat_mask[:self.shard_tokens] if self.masked else None, rest_mask,
                        self._cut_starts(self.shard_tokens))
            self.pending, self.count = [rest], len(rest)
            self.pending_mask = [rest_mask] if self.masked else []

    def close(self) -> None:
        if self.count:
            self._write(np.concatenate(self.pending), None,
                        np.concatenate(self.pending_mask) if self.masked else None, None, self._cut_starts(self.count))
        self.pending, self.pending_mask, self.count = [], [], 0

    def _write(self, tokens: np.ndarray, rest: np.ndarray | None, mask: np.ndarray | None = None,
               rest_mask: np.ndarray | None = None, starts: np.ndarray | None = None) -> None:
        number = len(self.result.shards)
        name = f"{TOKENS_PREFIX}{number:05d}.npy"
        if mask is not None:  # before its tokens: a listed token shard always has its mask
            self.store.put_bytes(f"{MASK_PREFIX}{number:05d}.npy", _npy(mask))
        if starts is not None:  # likewise its document starts
            self.store.put_bytes(f"{DOCS_PREFIX}{number:05d}{DOCS_SUFFIX}", _npy(starts))
        self.store.put_bytes(name, _npy(tokens))
        shard = {"name": name, "tokens": int(len(tokens))}
        if mask is not None:
            shard["assistant_tokens"] = int(mask.sum())
        if starts is not None:
            shard["document_starts"] = int(len(starts))
        self.result.shards.append(shard)
        if rest is not None:  # written after the shard: it never names a shard that is not there
            state = {"settings": self.settings, "shards": self.result.shards, "kept_documents": self.kept,
                     "carry": rest.tolist()}
            if rest_mask is not None:
                state["carry_mask"] = rest_mask.tolist()
            if self.starts is not None:
                state["carry_starts"] = self.starts
            self.store.put_bytes(PROGRESS, json.dumps(state).encode())


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def read_progress(out: ObjectStore, settings: dict, output: str) -> dict | None:
    try:
        state = read_json_object(out, PROGRESS, what=f"--output {output}")
    except ObjectNotFound:
        return None
    except KilnError as err:
        raise KilnError(f"{err}; the record of an interrupted run is damaged: delete the folder and prepare "
                        "again") from None
    if state.get("settings") != settings:
        raise KilnError(f"--output {output} holds an interrupted run with other inputs or settings; use another "
                        f"--output or delete that folder")
    return state
