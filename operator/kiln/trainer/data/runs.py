"""Sorted runs of fixed-size records in a store: what the cluster-scale dedup stages (kiln.trainer.data.stages) hand
each other. A run is the raw concatenation of equal-length byte records in ascending byte order (every number in a
record is big-endian, so byte order is numeric order).

A worker's memory is bounded by these constants, not by the corpus (DataTrove's MinHash stages work the same way:
sorted signature files, merged): a writer holds at most SPILL_RECORDS records before it writes them as one more
sorted run; a merge reads at most FAN_IN runs at once, CHUNK_RECORDS records (and the reader's buffers) each, and
merges more runs than that in rounds through runs of its own; a group of equal keys is streamed, never held."""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator

from kiln.storage import ObjectStore
from kiln.storage.reader import open_reader

CHUNK_RECORDS = 4096  # records read from a run, or written to one, at a time
FAN_IN = 32  # runs merged at once: 32 × (a 1 MiB read buffer + ranged GETs of READ_BYTES) on S3, ~100 MiB
SPILL_RECORDS = 1 << 19  # records a writer holds before writing a run: ~40 MiB of 24-byte records
READ_BYTES = 1 << 20  # a run's ranged GETs (the store's default, 8 MiB, × FAN_IN would be GBs)


def write_run(store: ObjectStore, key: str, records: Iterable[bytes]) -> None:
    """`records`, already in order, as one object (atomic: a reader never sees half a run)."""
    records = iter(records)
    with store.open_writer(key) as out:
        while batch := b"".join(itertools.islice(records, CHUNK_RECORDS)):
            out.write(batch)


def read_run(store: ObjectStore, key: str, size: int) -> Iterator[bytes]:
    """The records of one run (or any object of `size`-byte records), CHUNK_RECORDS at a time."""
    with open_reader(store, key, READ_BYTES) as stream:
        while chunk := stream.read(size * CHUNK_RECORDS):
            if len(chunk) % size:
                raise ValueError(f"{store.url(key)}: {len(chunk)} bytes is not a whole number of {size}-byte records")
            for at in range(0, len(chunk), size):
                yield chunk[at:at + size]


class Spill:
    """Records bound for several runs (one sequence per `part`), written as sorted runs `key(part, n)` whenever
    SPILL_RECORDS records are held, so one input of any size costs at most that. Deterministic: a retry that adds
    the same records writes the same runs under the same keys."""

    def __init__(self, store: ObjectStore, key):
        self.store, self.key = store, key
        self.held: defaultdict[int, list[bytes]] = defaultdict(list)
        self.spills: defaultdict[int, int] = defaultdict(int)
        self.size = 0

    def add(self, part: int, record: bytes) -> None:
        self.held[part].append(record)
        self.size += 1
        if self.size >= SPILL_RECORDS:
            self.flush()

    def flush(self) -> None:
        for part, records in sorted(self.held.items()):
            records.sort()
            write_run(self.store, self.key(part, self.spills[part]), records)
            self.spills[part] += 1
        self.held.clear()
        self.size = 0


def merge_runs(store: ObjectStore, keys: list[str], size: int, scratch: str) -> list[str]:
    """`keys` reduced to at most FAN_IN runs holding the same records, by merging FAN_IN at a time into runs
    under `scratch` (a prefix of their own, away from `keys`: a retry rewrites them identically)."""
    level = 0
    while len(keys) > FAN_IN:
        merged = []
        for g in range(0, len(keys), FAN_IN):
            key = f"{scratch}{level:02d}-{g // FAN_IN:06d}.run"
            write_run(store, key, heapq.merge(*(read_run(store, k, size) for k in keys[g:g + FAN_IN])))
            merged.append(key)
        keys, level = merged, level + 1
    return keys


def merged(store: ObjectStore, keys: list[str], size: int, scratch: str) -> Iterator[bytes]:
    """Every record of the runs `keys`, in order, with at most FAN_IN runs open."""
    return heapq.merge(*(read_run(store, k, size) for k in merge_runs(store, keys, size, scratch)))


def merged_groups(store: ObjectStore, keys: list[str], size: int, key_bytes: int,
                  scratch: str) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """Every group of records sharing their first `key_bytes` bytes, across all runs `keys`, as (its smallest
    record, an iterator of the others in ascending order: consume it before the next group); only groups of two
    or more (a lone record duplicates nothing)."""
    for _, group in itertools.groupby(merged(store, keys, size, scratch), key=lambda r: r[:key_bytes]):
        first = next(group)
        second = next(group, None)
        if second is not None:
            yield first, itertools.chain([second], group)
