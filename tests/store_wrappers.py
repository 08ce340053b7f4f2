"""A pass-through ObjectStore for tests that watch or change a few calls of a real store."""

from __future__ import annotations

from kiln.storage import ObjectStore


class PassThroughStore(ObjectStore):
    """The wrapped store, unchanged; a test overrides the calls it watches. open_writer is ObjectStore's
    default (spool, then put_file), as for any wrapper that does not stream."""

    def __init__(self, inner: ObjectStore):
        self.inner, self.uri = inner, inner.uri

    def put_file(self, key, path):
        self.inner.put_file(key, path)

    def put_bytes(self, key, data):
        self.inner.put_bytes(key, data)

    def get_file(self, key, path):
        self.inner.get_file(key, path)

    def get_bytes(self, key, offset=0, length=None):
        return self.inner.get_bytes(key, offset, length)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    def size(self, key):
        return self.inner.size(key)
