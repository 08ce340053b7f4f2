"""`kiln data prepare`: text files → token shards that `data.uri` reads, in bounded memory (docs/models.md).

The stages, a module each: reading (kiln.trainer.data.prepare_read), cleaning (prepare_clean: normalising,
near-duplicates), writing (prepare_write: shards, progress, manifest); `prepare` here runs them in order.

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

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

from kiln.errors import KilnError
from kiln.storage import open_store
from kiln.storage.reader import open_reader
from kiln.trainer.data.chat import ChatRefused, token_mask
from kiln.trainer.data.prepare_clean import NearDuplicates, normalise, normalise_messages
from kiln.trainer.data.prepare_read import SUFFIXES, MAX_DOC_BYTES, documents, input_files  # noqa: F401  (SUFFIXES: re-exported)
from kiln.trainer.data.prepare_write import MANIFEST, PROGRESS, Prepared, ShardWriter, read_progress, token_dtype


FORMATS = ("text", "chat")
BATCH_CHARS = 8_000_000  # a tokenizer batch is cut here too: 1,000 long documents must not all be in memory


def prepare(inputs: list[str], *, tokenizer_uri: str, output: str, text_field: str | None = None, min_chars: int = 1,
            dedup: str = "exact", minhash_threshold: float = 0.8, eos: str | None = None,
            shard_tokens: int = 100_000_000, batch_docs: int = 1000, endpoint: str | None = None,
            format: str = "text", max_doc_bytes: int = MAX_DOC_BYTES, quality: dict | None = None, log=print,
            progress=None) -> Prepared | None:
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
    if quality and chat:
        raise KilnError("--gopher, --c4 and --languages filter text documents: not with --format chat")
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
    if quality:  # kiln.trainer.data.quality: DataTrove's Gopher, C4 and language filters
        settings["quality"] = quality
    from kiln.trainer.data.quality import apply, make_filters

    filters = make_filters(quality or {}, endpoint)
    near = NearDuplicates(minhash_threshold) if dedup == "minhash" else None
    result = Prepared()
    writer = ShardWriter(out, shard_tokens, token_dtype(vocab), result, settings, masked=chat)
    unfinished = read_progress(out, settings, output)
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

    files = [(store, key) for uri in inputs for store, key in input_files(uri, endpoint)]
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
                    if filters:
                        text, why = apply(filters, text)
                        if text is None:
                            result.removed[why] += 1
                            continue
                        key_text = text
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
        **({"quality": quality} if quality else {}),
        "documents_in": result.documents_in, "documents_out": result.documents_out, "tokens": result.tokens,
        **({"format": "chat", "chat_template": renderer.source,
            "assistant_tokens": sum(s["assistant_tokens"] for s in result.shards)} if chat else {}),
        "removed": dict(sorted(result.removed.items())), "shards": result.shards,
    }
    out.put_bytes(MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    out.delete(PROGRESS)
    return result
