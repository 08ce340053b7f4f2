"""torch.distributed.checkpoint (DCP) over a kiln ObjectStore: its file-system interface, writer and reader.

DCP's FileSystemWriter/Reader do the (de)serialisation; `StoreFS` swaps their file system for an ObjectStore.
A shard is hashed (sha256, for the COMMIT) while DCP writes it, and streamed into the store as it is written:
on S3 full parts upload in the background while DCP serialises the rest (kiln.storage.s3.MultipartWriter), on
file:// the shard is written in place. Reads come from the bytes the restore already downloaded and checked
(`fetched`), a verified host-memory copy, or block-aligned ranged GETs with parallel read-ahead (`RangedReader`).

Loading runs no code from the checkpoint: its bytes come from a bucket that others may be able to write (the
COMMIT's sha256 proves integrity, not origin). DCP reads `.metadata` with pickle.load and non-tensor items with
torch.load(weights_only=False); `StoreReader` reads the metadata with an unpickler that admits only DCP's
metadata classes, and `SafeLoadPlanner` loads the items with weights_only=True (tensors already are). A file
that would run code is refused with `UnsafeCheckpoint`, naming it.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import os
import pickle
import threading
from collections.abc import Callable, Generator
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    _FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from kiln.errors import KilnError
from kiln.storage import ObjectStore
from kiln.storage.commit import HASH_CHUNK, FileEntry
from kiln.storage.reader import BlockReader, RangedReader


class StoreFS(FileSystemBase):
    """DCP's file-system interface over an ObjectStore. Paths are '/'-joined keys relative to the store root.

    A written file is recorded (size, sha256) in `written` once it is stored; a `*.tmp` file (DCP writes
    `.metadata.tmp`, then renames it) is held until `rename` stores it under its final name.
    """

    def __init__(
        self,
        store: ObjectStore,
        read_block: int = 8 << 20,
        *,
        keep_dir: Path | None = None,
        local_files: dict[str, Path] | None = None,
        fetched: dict[str, list[bytes]] | None = None,
        check_remote: Callable[[str], None] | None = None,
    ):
        self.store = store
        self.read_block = read_block
        self.keep_dir = keep_dir  # a copy of every uploaded file is written here too (the host-memory copy)
        self.local_files = local_files or {}  # file name → verified local copy, read instead of the store
        self.fetched = fetched or {}  # file name → its verified bytes (HASH_CHUNK blocks), dropped once read
        self.check_remote = check_remote  # called with a file name before it is first read from the store
        self.written: dict[str, FileEntry] = {}  # key → entry, for the COMMIT
        self._pending: dict[str, tuple[Path | bytes, FileEntry]] = {}  # *.tmp key → local file or its bytes
        self.errors: list[tuple[str, BaseException]] = []  # files that failed, in any writer thread
        self._lock = threading.Lock()

    def _publish(self, key: str, entry: FileEntry) -> None:
        """`key` is stored whole: record it for the COMMIT."""
        with self._lock:
            self.written[key] = entry

    def _keep_copy(self, key: str) -> Path | None:
        """Where the host-memory copy of an uploaded file goes (None: no copy, or the store is local)."""
        if self.keep_dir is None or self.store.local_path(key) is not None:
            return None
        self.keep_dir.mkdir(parents=True, exist_ok=True)
        return self.keep_dir / key.rsplit("/", 1)[-1]

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        key = str(path)
        if "r" in mode:
            with self._read_stream(key) as stream:
                yield stream
            return
        try:
            local = self.store.local_path(key)
            with contextlib.ExitStack() as stack:
                if local is not None:  # file://: in place (the COMMIT, not a rename, makes it count)
                    local.parent.mkdir(parents=True, exist_ok=True)
                    sink = stack.enter_context(open(local, "wb"))
                elif key.endswith(".tmp"):  # .metadata: small, stored by rename()
                    sink = io.BytesIO()
                else:  # streamed into the store; an exception in the block aborts the upload
                    sink = stack.enter_context(self.store.open_writer(key))
                copy_to = self._keep_copy(key) if not key.endswith(".tmp") else None
                copy = stack.enter_context(open(copy_to, "wb")) if copy_to is not None else None
                stream = HashingWriter(sink, copy)
                yield stream
                held = local if local is not None else sink.getvalue() if isinstance(sink, io.BytesIO) else None
            entry = FileEntry(stream.size, stream.sha.hexdigest())
            if key.endswith(".tmp"):
                with self._lock:
                    self._pending[key] = (held, entry)
                return
            self._publish(key, entry)
        except BaseException as err:
            # DCP's extra writer threads drop exceptions; StoreWriter re-raises what is recorded here
            with self._lock:
                self.errors.append((key, err))
            raise

    @contextlib.contextmanager
    def _read_stream(self, key: str) -> Generator[io.IOBase, None, None]:
        name = key.rsplit("/", 1)[-1]
        with self._lock:
            blocks = self.fetched.pop(name, None)  # DCP reads each file once: free its bytes after
        if blocks is not None:
            with BlockReader(blocks, HASH_CHUNK, sum(len(b) for b in blocks)) as reader:
                yield reader
            return
        local = self.local_files.get(name)
        if local is None and self.check_remote is not None:
            self.check_remote(name)
        local = local or self.store.local_path(key)
        if local is not None:
            with open(local, "rb") as f:
                yield f
            return
        reader = RangedReader(self.store, key, self.read_block)
        try:
            yield reader
        finally:
            reader.close()

    def rename(self, path, new_path) -> None:
        src, dst = str(path), str(new_path)
        with self._lock:
            held, entry = self._pending.pop(src)
        if isinstance(held, bytes):
            self.store.put_bytes(dst, held)
            copy_to = self._keep_copy(dst)
            if copy_to is not None:
                copy_to.write_bytes(held)
        else:
            os.replace(held, self.store.local_path(dst))
        self._publish(dst, entry)

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def mkdir(self, path) -> None:
        local = self.store.local_path(str(path))
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path) -> None:
        self.store.delete(str(path))


class HashingWriter(io.RawIOBase):
    """Passes writes through to a stream (and an optional copy) while computing their sha256, so a shard is
    never read back to hash it (DCP writes each file sequentially: torch.save streams its zip, offsets come
    from tell())."""

    def __init__(self, f, copy=None):
        self.f, self.copy = f, copy
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.f.write(b)
        if self.copy is not None:
            self.copy.write(b)
        self.sha.update(b)
        self.size += len(memoryview(b).cast("B"))
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:  # the stream is closed by its owner
        pass


class StoreWriter(_FileSystemWriter):
    """DCP's FileSystemWriter with its file system swapped for StoreFS."""

    def __init__(self, fs: StoreFS, step_prefix: str, *, thread_count: int, sync_files: bool):
        super().__init__(step_prefix, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count)
        self.fs = fs
        self.path = step_prefix

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        if self.fs.errors:  # a shard failed in a writer thread: fail the save on every rank (DCP gathers this)
            key, err = self.fs.errors[0]
            raise OSError(f"writing {self.fs.store.url(key)} failed: {type(err).__name__}: {err}") from err
        return result


class UnsafeCheckpoint(KilnError):
    """A checkpoint file that would run code if it were loaded (or is not what DCP writes); never loaded."""


# Everything DCP's .metadata pickle refers to (torch.distributed.checkpoint.metadata and filesystem, plus
# torch.Size, dtypes and layouts); any other global (os.system, builtins.eval, ...) is refused.
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a torch.layout up by its name
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals ("Restricting Globals"): only METADATA_GLOBALS and torch
    dtypes resolve. Exact names only: a dotted name cannot walk from an allowed class to anything else."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            # Some Pythons (Debian's 3.11.2 in kiln's trainer image) pickle an enum member as
            # getattr(EnumClass, "NAME"): resolve exactly that, and only for an allowed enum's member.
            return self._enum_member
        raise UnsafeCheckpoint(
            f"{self.source} refers to {module}.{name}, which DCP checkpoint metadata never holds: refused without "
            f"loading it (unpickling it would run code). Was the checkpoint written by someone else?"
        )


    def _enum_member(self, cls, name):
        allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__name__ in METADATA_GLOBALS.get(
            cls.__module__, ())
        if allowed and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise UnsafeCheckpoint(
            f"{self.source} asks for getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}), which DCP "
            f"checkpoint metadata never holds: refused without loading it (unpickling it would run code). Was the "
            f"checkpoint written by someone else?"
        )


def load_metadata(file, source: str) -> Metadata:
    """DCP's Metadata from a .metadata stream, running nothing from it; UnsafeCheckpoint naming `source`."""
    try:
        metadata = MetadataUnpickler(file, source).load()
    except UnsafeCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or garbled pickle: say so, naming the file
        raise UnsafeCheckpoint(f"{source} is not DCP checkpoint metadata ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{source} is not DCP checkpoint metadata (it holds a {type(metadata).__name__})")
    return metadata


class StoreReader(FileSystemReader):
    """DCP's FileSystemReader with its file system swapped for StoreFS, reading without running code."""

    def __init__(self, fs: StoreFS, step_prefix: str):
        super().__init__(step_prefix)
        self.fs = fs
        self.path = step_prefix
        # what this rank refused: DCP folds a failed metadata read into an AssertionError's text
        self.refused: UnsafeCheckpoint | None = None

    def refuse(self, err: UnsafeCheckpoint) -> UnsafeCheckpoint:
        self.refused = self.refused or err
        return err

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # FileSystemReader.read_metadata, with the restricted unpickler in place of pickle.load
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = load_metadata(f, self.fs.store.url(str(path)))
            except UnsafeCheckpoint as err:
                raise self.refuse(err) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as err:  # a tensor item (torch.load weights_only=True) that would run code
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            raise self.refuse(UnsafeCheckpoint(
                f"{', '.join(self.fs.store.url(self.fs.concat_path(self.path, f)) for f in files)}: a tensor would "
                f"run code when loaded ({_unsafe_global(err)}): refused"
            )) from None

    def source_of(self, read_item) -> str:
        """The URL of the file that holds a read item."""
        return self.fs.store.url(self.fs.concat_path(self.path, self.storage_data[read_item.storage_index].relative_path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items (the optimizer's param_groups: floats, bools,
    tuples) are unpickled with weights_only=True: DCP's own load_bytes uses weights_only=False."""

    def __init__(self, reader: StoreReader, **kwargs):
        super().__init__(**kwargs)
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise self.reader.refuse(UnsafeCheckpoint(
                f"{self.reader.source_of(read_item)}: item {read_item.dest_index.fqn} would run code when loaded "
                f"({_unsafe_global(err)}): refused"
            )) from None
        # hand DCP's placement logic (flattened keys → nested state) bytes pickled here from plain data
        plain = io.BytesIO()
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def _unsafe_global(err: BaseException) -> str:
    """The line of torch's weights_only error that names the refused global, else its first line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    named = [ln for ln in lines if "global" in ln.lower()]
    return (named or lines or [type(err).__name__])[0][:300]
