"""One small object-store interface, with `file://` and S3 (`s3://`, any S3-compatible endpoint) behind it.

Keys are '/'-separated and relative to the store's root (the URI's path or bucket prefix), so callers never
see which backend they use. Credentials come only from the environment (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, which the operator maps from the Secret named in checkpoint.credentialsSecret).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from kiln.errors import KilnError


class ObjectNotFound(KilnError, FileNotFoundError):
    """The key does not exist in the store."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store root
    size: int


class ObjectStore(ABC):
    """put/get a file or bytes, stream a write, list a prefix, delete, exists, size. Writes of one key are atomic."""

    uri: str  # the root, for messages

    @contextlib.contextmanager
    def open_writer(self, key: str) -> Generator[BinaryIO, None, None]:
        """A stream whose bytes become `key` when the block exits normally; if it raises, nothing is stored.
        This default spools to a temporary file and calls put_file; the stores override it to stream."""
        with tempfile.NamedTemporaryFile(prefix="kiln-put-") as f:
            yield f
            f.flush()
            self.put_file(key, f.name)

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_file(self, key: str, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> bytes: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix` (recursive), sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one key; deleting a missing key is not an error."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; raises ObjectNotFound."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        objects = self.list(prefix)
        for obj in objects:
            self.delete(obj.key)
        return len(objects)

    def local_path(self, key: str) -> Path | None:
        """The file behind `key` when the store is a local filesystem (lets DCP write in place), else None."""
        return None

    def url(self, key: str) -> str:
        return self.uri.rstrip("/") + "/" + key


class FileStore(ObjectStore):
    """`file:///path/`: a directory. Writes go to a temporary name and are renamed, so readers never see half a file."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise KilnError(f"invalid object key {key!r} for {self.uri}: keys are relative and may not contain '..'")
        return self.root / key

    def local_path(self, key: str) -> Path:
        return self._path(key)

    @contextlib.contextmanager
    def open_writer(self, key: str) -> Generator[BinaryIO, None, None]:
        """Written to a temporary name, fsync'd, then renamed over `key`."""
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        if Path(path).resolve() == self._path(key).resolve():
            return  # already in place (DCP wrote it there)
        with open(path, "rb") as src, self.open_writer(key) as dst:
            shutil.copyfileobj(src, dst)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.open_writer(key) as f:
            f.write(data)

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFound(f"{self.url(key)} does not exist")
        shutil.copyfile(src, path)

    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url(key)} does not exist") from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the directory the prefix names (a prefix may end mid-name, like S3).
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue  # an unfinished write
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    out.append(ObjectInfo(key, full.stat().st_size))
                except FileNotFoundError:
                    continue  # deleted between the walk and the stat (retention, a concurrent cleanup)
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Drop directories left empty, so a deleted step leaves no trace.
        parent = path.parent
        while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url(key)} does not exist") from None


def open_store(
    uri: str, *, endpoint: str | None = None, env: Mapping[str, str] | None = None, **s3_options
) -> ObjectStore:
    """The store rooted at `uri` (file:///path/ or s3://bucket/prefix/); S3 keys come from `env` (os.environ)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise KilnError(f"{uri!r}: file:// URIs need an absolute path, like file:///data/ckpt/")
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        from kiln.storage.s3 import S3Store  # the minio client only when S3 is used

        if not parsed.netloc:
            raise KilnError(f"{uri!r}: s3:// URIs name a bucket, like s3://checkpoints/run-1/")
        return S3Store(
            bucket=parsed.netloc,
            prefix=parsed.path.lstrip("/"),
            endpoint=endpoint,
            env=os.environ if env is None else env,
            **s3_options,
        )
    raise KilnError(
        f"{uri!r}: unknown scheme {parsed.scheme or '(none)'!r}; use s3://bucket/prefix/ or file:///path/"
    )
