"""A seekable, buffered read stream over one object, for readers that must not hold a whole file (kiln data
prepare): a local file is opened as it is; any other store is read in ranged GETs of `chunk` bytes
(`ObjectStore.get_bytes(key, offset, length)`, each retried on its own by the store), so memory stays at a few
chunks whatever the object's size, and pyarrow can seek to a parquet footer and its row groups. The checkpoint
restore (kiln.trainer.checkpoint.dcp_store) reads through the same `RangedReader`, with more blocks ahead."""

from __future__ import annotations

import io
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from kiln.storage.store import ObjectStore

CHUNK = 8 << 20  # bytes per ranged GET: few requests, bounded memory


class BlockReader(io.RawIOBase):
    """A seekable read-only stream over an object held as equal-size blocks (the last may be shorter)."""

    def __init__(self, blocks: list[bytes], block: int, length: int):
        self.blocks, self.block, self.length = blocks, block, length
        self.pos = 0

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

    def _block(self, b: int) -> bytes:
        return self.blocks[b]

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        view = memoryview(buf).cast("B")
        done = 0
        while done < n:
            b, start = divmod(self.pos + done, self.block)
            data = self._block(b)
            take = min(len(data) - start, n - done)
            view[done : done + take] = data[start : start + take]
            done += take
        self.pos += n
        return n


class RangedReader(BlockReader):
    """A BlockReader over one stored object, its blocks fetched by ranged GETs as they are first read.

    torch.load reads in many small pieces, mostly forwards: each block is fetched once, and the next
    `ahead` blocks are fetched in parallel in the background, so a sequential scan runs at parallel-GET speed.
    """

    def __init__(
        self, store: ObjectStore, key: str, block: int, ahead: int = 8, pool: ThreadPoolExecutor | None = None
    ):
        super().__init__(OrderedDict(), block, store.size(key))
        self.store, self.key, self.ahead = store, key, ahead
        self.nblocks = (self.length + block - 1) // block
        self.pool = pool or ThreadPoolExecutor(ahead, thread_name_prefix="kiln-read-ahead")
        self._own_pool = pool is None

    def _block(self, b: int) -> bytes:
        for nb in range(b, min(b + 1 + self.ahead, self.nblocks)):
            if nb not in self.blocks:
                off = nb * self.block
                self.blocks[nb] = self.pool.submit(
                    self.store.get_bytes, self.key, off, min(self.block, self.length - off)
                )
        self.blocks.move_to_end(b)
        data = self.blocks[b].result()
        while len(self.blocks) > 2 * (self.ahead + 1):  # drop the oldest blocks (reads move forwards)
            self.blocks.popitem(last=False)
        return data

    def close(self) -> None:
        if self._own_pool:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.blocks.clear()
        super().close()


def open_reader(store: ObjectStore, key: str, chunk: int | None = None) -> io.BufferedIOBase:
    """A binary, seekable stream of `key` (close it after use), read `chunk` (default CHUNK) bytes at a time."""
    path = store.local_path(key)
    if path is not None:
        return open(path, "rb")
    # one block ahead: the next GET overlaps parsing the current one; at most 4 blocks are held
    return io.BufferedReader(RangedReader(store, key, block=chunk or CHUNK, ahead=1), buffer_size=1 << 20)
