"""A seekable, buffered read stream over one object, for readers that must not hold a whole file (kiln data
prepare): a local file is opened as it is; any other store is read in ranged GETs of `chunk` bytes
(`ObjectStore.get_bytes(key, offset, length)`, each retried on its own by the store), so memory stays at one
chunk whatever the object's size, and pyarrow can seek to a parquet footer and its row groups."""

from __future__ import annotations

import io

from kiln.storage.store import ObjectStore

CHUNK = 8 << 20  # bytes per ranged GET: few requests, bounded memory


class RangedReader(io.RawIOBase):
    def __init__(self, store: ObjectStore, key: str, size: int):
        self.store, self.key, self.length, self.pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.length - self.pos)
        if want <= 0:
            return 0
        data = self.store.get_bytes(self.key, self.pos, want)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def open_reader(store: ObjectStore, key: str, chunk: int | None = None) -> io.BufferedIOBase:
    """A binary, seekable stream of `key` (close it after use), read `chunk` (default CHUNK) bytes at a time."""
    path = store.local_path(key)
    if path is not None:
        return open(path, "rb")
    return io.BufferedReader(RangedReader(store, key, store.size(key)), buffer_size=chunk or CHUNK)
