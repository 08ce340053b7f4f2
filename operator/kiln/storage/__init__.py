"""Object storage (S3/MinIO through the `minio` client, and file://) and the checkpoint commit protocol.

Imports no other kiln package except the leaf `kiln.errors`.
"""

from kiln.storage.store import FileStore, ObjectInfo, ObjectNotFound, ObjectStore, open_store

__all__ = ["FileStore", "ObjectInfo", "ObjectNotFound", "ObjectStore", "open_store"]
