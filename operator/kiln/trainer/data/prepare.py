"""`kiln data prepare`: text files → token shards that `data.uri` reads, in bounded memory (docs/models.md).

Documents come from .txt files (one document per file), .jsonl files (one per line, the text in
`text_field`) and .parquet files (one per row of the `text_field` column, read with pyarrow), in local
folders, file:// or s3:// prefixes, in sorted order, each streamed (kiln.storage.reader; a record past
max_doc_bytes is skipped and counted as too_large). Each document is decoded as UTF-8,
normalised (Unicode NFC, \\r\\n → \\n, surrounding whitespace stripped), filtered (too short, a missing field,
an undecodable or unparsable line: counted, never a crash), deduplicated (exactly by sha256 of the normalised
text; with dedup minhash also near-duplicates, `NearDuplicates`), tokenized in batches with the `tokenizers`
library (its batch encoding runs on every core, in a background thread while the next batch is read) and
appended, with an optional end-of-document token, to `tokens-NNNNN.npy` shards of `shard_tokens` tokens (uint16 when
the vocabulary fits, else uint32), each with a `docs-NNNNN.idx` of the offsets where its documents start
(data.packing packs whole documents by them). `manifest.json`, written last, counts documents in and out, tokens,
what each filter removed, and lists the shards; a folder with a manifest is complete and a rerun leaves it alone. A
rerun of an interrupted run keeps its finished shards and tokenizes only the documents after them (progress.json).

Chat data (format "chat"): each .jsonl line's or .parquet row's `messages` is a conversation of {role, content}
messages (contents normalised as above); it is rendered with the tokenizer's chat template, and each shard gets a
`mask-NNNNN.npy` of one byte per token, 1 for the assistant's tokens (kiln.trainer.data.chat), which the trainer's
data.format chat takes the loss on. A conversation without an assistant turn, with malformed messages, or that
the template refuses is counted under its reason.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import json
import unicodedata
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.bounded import read_json_object
from kiln.storage.reader import open_reader
from kiln.trainer.data.chat import ChatRefused, check_messages, token_mask
from kiln.trainer.data.shards import DOCS_PREFIX, DOCS_SUFFIX, MASK_PREFIX, TOKENS_PREFIX
from kiln.storage.store import ObjectNotFound

MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # an unfinished run's state (kiln.trainer.data.prepare.ShardWriter); gone once MANIFEST is there
SUFFIXES = (".txt", ".jsonl", ".parquet")
FORMATS = ("text", "chat")


def normalise(text: str) -> str:
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n")).strip()


def normalise_messages(messages) -> list[dict]:
    """A conversation's messages as {role, content} with each content normalised (chat.check_messages checks
    the shape first; ChatRefused says what is wrong)."""
    check_messages(messages)
    return [{"role": m["role"], "content": normalise(m["content"])} for m in messages]


MINHASH_PERMUTATIONS = 128
SHINGLE_WORDS = 5


class NearDuplicates:
    """MinHash + LSH (the `datasketch` library) over word 5-gram shingles of the lower-cased text: a document
    whose estimated Jaccard similarity to one already kept reaches `threshold` is a near-duplicate."""

    def __init__(self, threshold: float):
        from datasketch import MinHashLSH

        self.lsh = MinHashLSH(threshold=threshold, num_perm=MINHASH_PERMUTATIONS)
        self.kept = 0

    def seen_before(self, text: str) -> bool:
        from datasketch import MinHash

        words = text.lower().split()
        shingles = {" ".join(words[i:i + SHINGLE_WORDS]).encode()
                    for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
        m = MinHash(num_perm=MINHASH_PERMUTATIONS, seed=1)
        m.update_batch(shingles)
        if self.lsh.query(m):
            return True
        self.lsh.insert(str(self.kept), m)
        self.kept += 1
        return False


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _inputs(uri: str, endpoint: str | None) -> Iterator[tuple[ObjectStore, str]]:
    """(store, key) of every .txt/.jsonl/.parquet under an input (a file or a folder/prefix), sorted."""
    if not uri.startswith(("file://", "s3://")):
        uri = f"file://{Path(uri).resolve()}"
    if uri.startswith("file://") and Path(uri.removeprefix("file://")).is_file():
        folder, key = uri.rsplit("/", 1)
        yield open_store(folder + "/", endpoint=endpoint), key
        return
    store = open_store(uri, endpoint=endpoint)
    keys = [o.key for o in store.list("") if o.key.endswith(SUFFIXES)]
    if not keys:
        raise KilnError(f"--input {uri}: no .txt, .jsonl or .parquet files there")
    for key in keys:
        yield store, key


MAX_DOC_BYTES = 32 << 20  # a record (a .txt file, a .jsonl line) past this is skipped and counted as too_large
BATCH_CHARS = 8_000_000  # a tokenizer batch is cut here too: 1,000 long documents must not all be in memory


def documents(stream: BinaryIO, key: str, text_field: str, counts: Counter, want: type = str,
              max_bytes: int = MAX_DOC_BYTES) -> Iterator:
    """The texts of one file, read from `stream` record by record (not yet normalised), or with want=list its
    conversations (the `text_field` of each record being a list of messages); what cannot be read is counted
    under its reason. At most one record of `max_bytes` (a parquet file: one record batch) is in memory: a
    longer record is skipped unread and counted as too_large."""
    if key.endswith(".parquet"):
        yield from _parquet_documents(stream, text_field, counts, want)
        return
    if key.endswith(".txt"):
        if want is not str:  # a text file holds no conversation
            counts["missing_field"] += 1
            return
        raw = stream.read(max_bytes + 1)
        if len(raw) > max_bytes:
            counts["too_large"] += 1
            return
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            counts["undecodable"] += 1
        return
    for line in _lines(stream, max_bytes, counts):
        if not line.strip():
            continue
        try:
            doc = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            counts["undecodable"] += 1
            continue
        except (ValueError, RecursionError):  # JSONDecodeError, an int past the digit limit, nesting too deep
            counts["invalid_json"] += 1
            continue
        text = doc.get(text_field) if isinstance(doc, dict) else None
        if not isinstance(text, want):
            counts["missing_field"] += 1
            continue
        yield text


def _lines(stream: BinaryIO, max_bytes: int, counts: Counter) -> Iterator[bytes]:
    """The lines of a stream; one longer than max_bytes is read past in pieces, never whole, and counted."""
    while line := stream.readline(max_bytes + 1):
        if len(line) > max_bytes and not line.endswith(b"\n"):
            counts["too_large"] += 1
            while (rest := stream.readline(max_bytes)) and not rest.endswith(b"\n"):
                pass
            continue
        yield line


PARQUET_BATCH_ROWS = 1024


def _parquet_documents(stream: BinaryIO, text_field: str, counts: Counter, want: type = str) -> Iterator:
    """The `text_field` column of a parquet file, record batch by record batch (pyarrow reads one row group's
    column at a time); a row without a string there is missing_field, a file pyarrow cannot read is
    unreadable_file."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError("parquet input needs pyarrow: pip install 'kiln[train]'") from None
    try:
        parquet = pq.ParquetFile(stream)
    except (pa.ArrowException, OSError):
        counts["unreadable_file"] += 1
        return
    if text_field not in parquet.schema_arrow.names:
        counts["missing_field"] += parquet.metadata.num_rows
        return
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if isinstance(value, want):
                yield value
            else:
                counts["missing_field"] += 1


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


def _progress(out: ObjectStore, settings: dict, output: str) -> dict | None:
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


def prepare(inputs: list[str], *, tokenizer_uri: str, output: str, text_field: str | None = None, min_chars: int = 1,
            dedup: str = "exact", minhash_threshold: float = 0.8, eos: str | None = None,
            shard_tokens: int = 100_000_000, batch_docs: int = 1000, endpoint: str | None = None,
            format: str = "text", max_doc_bytes: int = MAX_DOC_BYTES, log=print, progress=None) -> Prepared | None:
    """Prepare `inputs` into token shards at `output`; None when `output` already holds a complete result. An
    interrupted run is resumed: its finished shards are kept and their documents are not tokenized again
    (they are read, filtered and hashed again, which rebuilds the dedup set and the counts). `progress`, when
    given, is called as progress(files done, files in all, documents kept so far, shards written so far) after
    each tokenized batch and each input file.

    Memory is bounded: inputs are streamed (kiln.storage.reader; s3:// in ranged GETs), a record past
    `max_doc_bytes` is skipped and counted as too_large, a tokenizer batch holds at most `batch_docs` documents
    and about BATCH_CHARS characters, and the shard being filled holds at most `shard_tokens` tokens. What grows
    with the data is the dedup state (docs/models.md gives the bytes per kept document).

    format "chat": each record's `text_field` (default "messages") is a conversation, rendered with the
    tokenizer's chat template (kiln.trainer.data.chat) and written with its assistant mask (mask-NNNNN.npy); a
    conversation the template refuses is counted under the reason, like any other filter."""
    from kiln.trainer.model.hf_folder import load_tokenizer, vocab_size

    out = open_store(output, endpoint=endpoint)
    if out.exists(MANIFEST):
        log(f"kiln: {out.url(MANIFEST)} exists: {output} is already prepared; nothing to do")
        return None
    tokenizer = load_tokenizer(tokenizer_uri, endpoint)
    if tokenizer is None:
        raise KilnError("--tokenizer byte: data prepare needs a tokenizer.json or a model folder holding one")
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise KilnError(f"--eos {eos!r} is not a token of {tokenizer_uri}")
    vocab = vocab_size(tokenizer)
    if format not in FORMATS:
        raise KilnError(f"--format {format}: use one of {', '.join(FORMATS)}")
    chat = format == "chat"
    text_field = text_field or ("messages" if chat else "text")
    renderer = None
    if chat:
        from kiln.trainer.data.chat import ChatRenderer, load_chat_template

        renderer = ChatRenderer(load_chat_template(tokenizer_uri, endpoint))
    if dedup not in ("none", "exact", "minhash") or not 0 < minhash_threshold <= 1:
        raise KilnError(f"--dedup {dedup} / --minhash-threshold {minhash_threshold}: use none, exact or minhash, "
                        f"with a threshold in (0, 1]")
    settings = {"inputs": inputs, "tokenizer": tokenizer_uri, "vocab_size": vocab, "text_field": text_field,
                "min_chars": min_chars, "dedup": dedup, "eos": eos, "shard_tokens": shard_tokens}
    if dedup == "minhash":
        settings["minhash_threshold"] = minhash_threshold
    if chat:
        settings["format"] = format
    near = NearDuplicates(minhash_threshold) if dedup == "minhash" else None
    result = Prepared()
    writer = ShardWriter(out, shard_tokens, token_dtype(vocab), result, settings, masked=chat)
    unfinished = _progress(out, settings, output)
    skip = 0
    if unfinished is not None:
        writer.resume(unfinished)
        skip = writer.kept
        result.tokens = sum(s["tokens"] for s in result.shards) + writer.count
        log(f"kiln: resuming {output} after {len(result.shards)} finished shard(s) ({skip:,} documents)")
    seen: set[bytes] = set()
    batch: list[str] = []
    batch_chars = 0
    spans: list[list[tuple[int, int]]] = []  # chat: each batched text's assistant character spans

    tail = [eos_id] if eos_id is not None else []

    # text needs no character offsets: the tokenizers library's encode_batch_fast skips computing them
    encode = tokenizer.encode_batch if chat else getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encoding: tuple | None = None  # (the batch being encoded in the background, its spans)

    def collect() -> None:
        """Write the batch in the background once encoded (kept documents, in order)."""
        nonlocal encoding
        if encoding is None:
            return
        future, batch_spans = encoding
        encoding = None
        encoded = future.result()
        docs = [enc.ids + tail for enc in encoded]
        result.tokens += sum(len(d) for d in docs)
        masks = None
        if chat:  # an appended --eos is not the assistant's: no loss on it
            masks = [token_mask(enc.offsets, s) + [0] * len(tail) for enc, s in zip(encoded, batch_spans)]
        writer.add(docs, masks)
        if progress is not None:
            progress(done, len(files), result.documents_out, len(result.shards))

    def flush() -> None:
        """Start encoding the batch (the library runs it on every core, without the GIL) and write the one before
        it meanwhile: reading, normalising and hashing the next documents overlap the tokenizer."""
        nonlocal batch_chars, encoding
        if batch:
            future = encoder.submit(encode, list(batch), add_special_tokens=False)
            collect()
            encoding = (future, list(spans))
        batch.clear()
        spans.clear()
        batch_chars = 0

    files = [(store, key) for uri in inputs for store, key in _inputs(uri, endpoint)]
    done = 0
    with ThreadPoolExecutor(1) as encoder:  # one batch encoding while the next is read
        for store, key in files:
            with open_reader(store, key) as stream:
                for doc in documents(stream, key, text_field, result.removed, list if chat else str, max_doc_bytes):
                    result.documents_in += 1
                    if chat:
                        try:
                            messages = normalise_messages(doc)
                        except ChatRefused as refused:
                            result.removed[refused.reason] += 1
                            continue
                        text = "\n".join(m["content"] for m in messages)  # what length and near-dedup look at
                        key_text = json.dumps(messages, sort_keys=True, ensure_ascii=False)  # what exact dedup compares
                    else:
                        text = key_text = normalise(doc)
                    if len(text) < min_chars:
                        result.removed["too_short"] += 1
                        continue
                    if dedup != "none":  # minhash: exact duplicates first (cheap), then near ones
                        digest = hashlib.sha256(key_text.encode()).digest()[:16]
                        if digest in seen:
                            result.removed["duplicate"] += 1
                            continue
                        seen.add(digest)
                        if near is not None and near.seen_before(text):
                            result.removed["near_duplicate"] += 1
                            continue
                    if chat:  # rendered before it counts as kept: a refusal must not shift the resume point
                        try:
                            text, doc_spans = renderer.assistant_spans(messages)
                        except ChatRefused as refused:
                            result.removed[refused.reason] += 1
                            continue
                    result.documents_out += 1
                    if result.documents_out <= skip:
                        continue  # its tokens are in a finished shard or the carried-over remainder
                    batch.append(text)
                    batch_chars += len(text)
                    if chat:
                        spans.append(doc_spans)
                    if len(batch) >= batch_docs or batch_chars >= BATCH_CHARS:
                        flush()
            done += 1
            if progress is not None:
                progress(done, len(files), result.documents_out, len(result.shards))
        flush()
        collect()
    writer.close()
    # what could not be read never became a document, but it came in as one
    result.documents_in += sum(result.removed[k] for k in ("undecodable", "invalid_json", "missing_field",
                                                             "too_large"))
    # (an unreadable_file counts as one removal, not as documents: how many it held is unknown)
    manifest = {
        "tokenizer": tokenizer_uri, "vocab_size": vocab, "dtype": str(writer.dtype), "eos": eos,
        "text_field": text_field, "min_chars": min_chars, "dedup": dedup, "inputs": inputs,
        **({"minhash_threshold": minhash_threshold} if near is not None else {}),
        "documents_in": result.documents_in, "documents_out": result.documents_out, "tokens": result.tokens,
        **({"format": "chat", "chat_template": renderer.source,
            "assistant_tokens": sum(s["assistant_tokens"] for s in result.shards)} if chat else {}),
        "removed": dict(sorted(result.removed.items())), "shards": result.shards,
    }
    out.put_bytes(MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    out.delete(PROGRESS)
    return result
