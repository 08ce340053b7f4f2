"""Small files read whole from a bucket (COMMIT, trainer.json, a model folder's JSON and tokenizer files): each
kind has a size cap, checked before a byte is downloaded, and JSON that does not parse — malformed, not UTF-8,
nested deeper than the parser's recursion limit, a number too large — is one KilnError naming the file.

Whoever can write the bucket chooses these bytes: without a cap a 50 GB "config.json" is fetched into memory, and
a COMMIT nested 200,000 deep raised RecursionError in the middle of a restore.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.errors import KilnError
from kiln.storage.store import ObjectStore

KiB, MiB = 1 << 10, 1 << 20

# The largest file of each kind kiln reads whole; far above what a real one holds (a COMMIT lists ~150 bytes per
# shard; Llama 3's tokenizer.json is 9 MiB, Gemma 3's 33 MiB; the index of a 671B model ~8 MiB).
LIMITS = {
    "COMMIT": 64 * MiB,
    "trainer.json": 64 * MiB,
    "latest": 4 * KiB,
    "config.json": 4 * MiB,
    "generation_config.json": 1 * MiB,
    "model.safetensors.index.json": 64 * MiB,
    "tokenizer.json": 256 * MiB,
    "tokenizer_config.json": 16 * MiB,
    "special_tokens_map.json": 1 * MiB,
    "tokenizer.model": 64 * MiB,
    "chat_template.jinja": 1 * MiB,
    "progress.json": 64 * MiB,
}


def read_bytes(store: ObjectStore, key: str, *, kind: str | None = None, what: str = "") -> bytes:
    """The whole object `key`, refused with a KilnError naming it when it is larger than LIMITS[kind] (kind: the
    key's base name unless given). ObjectNotFound when it does not exist."""
    kind = kind or key.rsplit("/", 1)[-1]
    limit = LIMITS[kind]
    size = store.size(key)
    if size > limit:
        raise KilnError(f"{_prefix(what)}{store.url(key)} has {size} bytes; a {kind} file may have at most {limit}")
    data = store.get_bytes(key, 0, size)
    if len(data) > limit:  # rewritten since the size was read
        raise KilnError(f"{_prefix(what)}{store.url(key)} grew past {limit} bytes while it was read")
    return data


def parse_json(data: bytes, where: str) -> Any:
    """The JSON document in `data`; KilnError naming `where` for anything the parser refuses."""
    try:
        return json.loads(data)
    except RecursionError:
        raise KilnError(f"{where} is not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and ints past Python's digit limit
        raise KilnError(f"{where} is not valid JSON ({err})") from None


def read_json(store: ObjectStore, key: str, *, kind: str | None = None, what: str = "") -> Any:
    """read_bytes, then parse_json; every failure is one KilnError naming the file."""
    return parse_json(read_bytes(store, key, kind=kind, what=what), f"{_prefix(what)}{store.url(key)}")


def read_json_object(store: ObjectStore, key: str, *, kind: str | None = None, what: str = "") -> dict:
    doc = read_json(store, key, kind=kind, what=what)
    if not isinstance(doc, dict):
        raise KilnError(f"{_prefix(what)}{store.url(key)} is not a JSON object")
    return doc


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""
