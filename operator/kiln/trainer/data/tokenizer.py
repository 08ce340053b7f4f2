"""A `tokenizers.Tokenizer` from a URI, without importing torch: `kiln data prepare`'s cluster stages load it in
every worker pod, where torch's import would cost more than a small stage (kiln.trainer.model.hf_folder re-exports
these)."""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.storage import ObjectStore, open_store
from kiln.storage.bounded import read_bytes
from kiln.storage.store import ObjectNotFound


def _open(uri: str, endpoint: str | None, what: str) -> ObjectStore:
    try:
        return open_store(uri, endpoint=endpoint)
    except KilnError as err:
        raise KilnError(f"{what} {uri}: {err}") from None


def load_tokenizer(uri: str, endpoint: str | None = None):
    """A `tokenizers.Tokenizer` from a tokenizer.json or a folder holding one; None for 'byte'."""
    if uri == "byte":
        return None
    from tokenizers import Tokenizer

    if uri.rstrip("/").endswith(".json"):
        folder, key = uri.rstrip("/").rsplit("/", 1)
    else:
        folder, key = uri, "tokenizer.json"
    store = _open(folder + "/", endpoint, "data.tokenizer")
    try:
        raw = read_bytes(store, key, kind="tokenizer.json", what=f"data.tokenizer {uri}")
    except ObjectNotFound:
        raise KilnError(f"data.tokenizer {uri}: no {key} in {store.uri} (kiln reads tokenizer.json, the "
                        f"`tokenizers` library's format; set data.tokenizer to 'byte' or to one)") from None
    try:
        return Tokenizer.from_str(raw.decode())
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for a bad file
        raise KilnError(f"data.tokenizer {uri}: {key} is not a tokenizer the `tokenizers` library reads ({err})") from None


def vocab_size(tokenizer) -> int:
    return 256 if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)
