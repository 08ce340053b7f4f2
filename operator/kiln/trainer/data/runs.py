"""Sorted runs of fixed-size records in a store: what the cluster-scale dedup stages (kiln.trainer.data.stages) hand
each other. A run is the raw concatenation of equal-length byte records in ascending byte order (every number in a
record is big-endian, so byte order is numeric order). Merging the runs of a partition reads each one a chunk at a
time: a worker holds one chunk per run, whatever the size of the corpus (DataTrove's MinHash buckets stage merges
its sorted signature files the same way)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from kiln.storage import ObjectStore
from kiln.storage.reader import open_reader

CHUNK_RECORDS = 4096  # records read from a run at a time: the merge's memory is runs × this × record size


def write_run(store: ObjectStore, key: str, records: Iterable[bytes]) -> None:
    """`records` sorted, as one object (atomic: a reader never sees half a run)."""
    with store.open_writer(key) as out:
        for record in sorted(records):
            out.write(record)


def read_run(store: ObjectStore, key: str, size: int) -> Iterator[bytes]:
    """The records of one run (or any object of `size`-byte records), CHUNK_RECORDS at a time."""
    with open_reader(store, key) as stream:
        while chunk := stream.read(size * CHUNK_RECORDS):
            if len(chunk) % size:
                raise ValueError(f"{store.url(key)}: {len(chunk)} bytes is not a whole number of {size}-byte records")
            for at in range(0, len(chunk), size):
                yield chunk[at:at + size]


def merged_groups(store: ObjectStore, keys: list[str], size: int, key_bytes: int) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """Every group of records sharing their first `key_bytes` bytes, across all runs `keys`, as (its smallest
    record, an iterator of the others in ascending order: consume it before the next group); only groups of two
    or more (a lone record duplicates nothing). A group is streamed, never held: a document repeated a million
    times costs no memory here."""
    merged = heapq.merge(*(read_run(store, k, size) for k in keys))
    for _, group in itertools.groupby(merged, key=lambda r: r[:key_bytes]):
        first = next(group)
        second = next(group, None)
        if second is not None:
            yield first, itertools.chain([second], group)
