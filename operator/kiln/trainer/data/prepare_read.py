"""`kiln data prepare`'s reading: the input files under each --input (sorted), and the documents of each
(.txt: the file, .jsonl: a line's field, .parquet: a column's rows), streamed, a record past max_doc_bytes skipped
and counted as too_large, every failure counted, never a crash."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store


SUFFIXES = (".txt", ".jsonl", ".parquet")


def input_files(uri: str, endpoint: str | None) -> Iterator[tuple[ObjectStore, str]]:
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
