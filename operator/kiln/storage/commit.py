"""The checkpoint commit protocol (DESIGN.md §4): what a committed step is, and how it is written and checked.

    <root>/step-00001000/*.distcp, .metadata   DCP shards, written by every rank
    <root>/step-00001000/trainer.json          step, data cursor, RNG, hook state, goodput (rank 0)
    <root>/step-00001000/COMMIT                size and sha256 of every file above; written last
    <root>/latest                              "step-00001000", rewritten after COMMIT

A reader trusts only a step whose COMMIT exists and whose files all match it. The pure helpers (names,
manifests, retention) come first; the functions taking an ObjectStore do the I/O.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.storage.bounded import parse_json, read_bytes, read_json_object
from kiln.storage.store import ObjectInfo, ObjectNotFound, ObjectStore

log = logging.getLogger("kiln.storage")

COMMIT = "COMMIT"
TRAINER_STATE = "trainer.json"
LATEST = "latest"
COMMIT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8,})$")
HASH_CHUNK = 8 << 20


# -- pure -----------------------------------------------------------------------------------------------------


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name.strip().strip("/"))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Commit:
    step: int
    files: dict[str, FileEntry]  # name inside the step directory → size, sha256
    time: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        body = {
            "version": COMMIT_VERSION,
            "step": self.step,
            "time": self.time,
            "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in sorted(self.files.items())},
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Commit:
        body = parse_json(data, where)
        try:
            files = {n: FileEntry(int(e["size"]), str(e["sha256"])) for n, e in body["files"].items()}
            return cls(step=int(body["step"]), files=files, time=float(body.get("time", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
            raise KilnError(f"{where} is not a valid COMMIT file ({err})") from None


def steps_from_listing(objects: list[ObjectInfo]) -> tuple[set[int], set[int]]:
    """(every step with any file, the steps with a COMMIT) from a listing of the checkpoint root."""
    seen, committed = set(), set()
    for obj in objects:
        head, _, name = obj.key.partition("/")
        step = parse_step(head)
        if step is None:
            continue
        seen.add(step)
        if name == COMMIT:
            committed.add(step)
    return seen, committed


def retention_plan(seen: set[int], committed: set[int], keep: int, current: int | None = None) -> list[int]:
    """Steps to delete after committing `current` (None: judge by the listing alone).

    Kept: the newest `keep` committed steps up to `current` (always `current` itself). Deleted: older commits,
    uncommitted leftovers older than the newest kept commit (crashed saves), and every step after `current`:
    those belong to an abandoned timeline (the run resumed from an earlier commit, e.g. because a newer one
    was damaged) and must never be resumed from again. With current=None, uncommitted steps newer than the
    newest commit are left alone (they may be a save in flight)."""
    if current is not None:
        committed = committed | {current}
    timeline = {s for s in committed if current is None or s <= current}
    if not timeline:
        return []
    kept = sorted(timeline, reverse=True)[: max(1, keep)]
    newest = kept[0]
    return sorted(
        s
        for s in seen | committed
        if s not in kept and (s in committed or s < newest or s > newest and current is not None)
    )


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# -- I/O through an ObjectStore ------------------------------------------------------------------------------


def _chunks(store: ObjectStore, key: str, size: int, parallelism: int) -> Iterator[bytes]:
    """The object's bytes in order, as parallel ranged GETs running up to 2 x `parallelism` chunks ahead."""
    ranges = iter([(off, min(HASH_CHUNK, size - off)) for off in range(0, size, HASH_CHUNK)])
    with ThreadPoolExecutor(parallelism) as pool:
        window = deque(pool.submit(store.get_bytes, key, *r) for r in itertools.islice(ranges, 2 * parallelism))
        while window:
            data = window.popleft().result()
            nxt = next(ranges, None)
            if nxt is not None:
                window.append(pool.submit(store.get_bytes, key, *nxt))
            yield data


def hash_object(
    store: ObjectStore, key: str, size: int, parallelism: int = 8, keep: bool = False
) -> tuple[str, list[bytes] | None]:
    """(sha256, the object's bytes in HASH_CHUNK blocks when `keep`) of a stored object. A local store is hashed
    in place (nothing kept: it can be read again for free); a remote one is read once by parallel ranged GETs
    hashed in order, and with `keep` its blocks are returned, so a loader uses the checked bytes instead of
    downloading them again."""
    local = store.local_path(key)
    if local is not None:
        return sha256_file(local), None
    h = hashlib.sha256()
    blocks: list[bytes] = []
    for data in _chunks(store, key, size, parallelism):
        h.update(data)
        if keep:
            blocks.append(data)
    return h.hexdigest(), blocks if keep else None


def committed_steps(store: ObjectStore) -> list[int]:
    """Committed steps, newest first (a COMMIT exists; its files are checked by verify_files)."""
    _, committed = steps_from_listing(store.list("step-"))
    return sorted(committed, reverse=True)


def read_commit(store: ObjectStore, step: int) -> Commit:
    key = f"{step_dir(step)}/{COMMIT}"
    commit = Commit.from_bytes(read_bytes(store, key, kind=COMMIT), where=store.url(key))
    if commit.step != step:
        raise KilnError(f"{store.url(key)} says step {commit.step}, not {step}")
    return commit


def fetch_verified(
    store: ObjectStore, step: int, commit: Commit, names: list[str], keep: bool = False, parallelism: int = 4
) -> tuple[list[str], dict[str, list[bytes]]]:
    """(problems, verified bytes) for the named files of a commit. Problems (empty if none): missing, wrong
    size, wrong sha256. Each file is read once, several in parallel (sha256 releases the GIL); with `keep`, the
    blocks of every remote file that matches are returned (name → HASH_CHUNK blocks) for the loader to read."""
    prefix = step_dir(step)

    def check(name: str) -> tuple[str | None, list[bytes] | None]:
        entry = commit.files[name]
        key = f"{prefix}/{name}"
        try:
            size = store.size(key)
        except ObjectNotFound:
            return f"{name} is missing", None
        if size != entry.size:
            return f"{name} has {size} bytes, COMMIT says {entry.size}", None
        digest, blocks = hash_object(store, key, size, keep=keep)
        if digest != entry.sha256:
            return f"{name} sha256 {digest[:12]}… does not match COMMIT {entry.sha256[:12]}…", None
        return None, blocks

    with ThreadPoolExecutor(max(1, parallelism)) as pool:
        results = dict(zip(names, pool.map(check, names)))
    problems = [p for p, _ in results.values() if p is not None]
    return problems, {n: blocks for n, (p, blocks) in results.items() if p is None and blocks is not None}


def verify_files(store: ObjectStore, step: int, commit: Commit, names: list[str], parallelism: int = 4) -> list[str]:
    """Problems (empty if none) with the named files of a commit: missing, wrong size, wrong sha256."""
    return fetch_verified(store, step, commit, names, parallelism=parallelism)[0]


def write_commit(store: ObjectStore, step: int, shard_files: dict[str, FileEntry], trainer_state: dict) -> Commit:
    """Rank 0, after every rank's shards are stored: trainer.json, then COMMIT, then latest (in that order)."""
    prefix = step_dir(step)
    state_bytes = (json.dumps(trainer_state, indent=1, sort_keys=True) + "\n").encode()
    store.put_bytes(f"{prefix}/{TRAINER_STATE}", state_bytes)
    files = dict(shard_files)
    files[TRAINER_STATE] = FileEntry(len(state_bytes), hashlib.sha256(state_bytes).hexdigest())
    commit = Commit(step=step, files=files)
    store.put_bytes(f"{prefix}/{COMMIT}", commit.to_bytes())
    store.put_bytes(LATEST, (prefix + "\n").encode())
    return commit


def read_trainer_state(store: ObjectStore, step: int) -> dict:
    return read_json_object(store, f"{step_dir(step)}/{TRAINER_STATE}", kind=TRAINER_STATE)


def read_latest(store: ObjectStore) -> int | None:
    """The step `latest` names (a hint for people and tools; readers still check COMMIT)."""
    try:
        return parse_step(read_bytes(store, LATEST, kind=LATEST).decode(errors="replace"))
    except (ObjectNotFound, KilnError):  # a hint only: a damaged one is as good as none
        return None


def apply_retention(store: ObjectStore, keep: int, current: int | None = None) -> list[int]:
    """Delete what retention_plan says; returns the deleted steps."""
    seen, committed = steps_from_listing(store.list("step-"))
    doomed = retention_plan(seen, committed, keep, current)
    for step in doomed:
        # COMMIT goes first, so a half-deleted step is never mistaken for a committed one.
        store.delete(f"{step_dir(step)}/{COMMIT}")
        store.delete_prefix(f"{step_dir(step)}/")
    return doomed
