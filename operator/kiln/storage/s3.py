"""S3 / MinIO / any S3-compatible endpoint, through the `minio` client.

Large files go up as parallel multipart uploads and come down as parallel ranged GETs; every call is retried
with backoff on transient failures (kiln.storage.retry) and fails fast, naming the endpoint and bucket, on
permanent ones (bad credentials, missing bucket).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.error import S3Error

from kiln.errors import KilnError
from kiln.storage.retry import PERMANENT_S3_CODES, RetryPolicy, call_with_retry
from kiln.storage.store import ObjectInfo, ObjectNotFound, ObjectStore

MiB = 1 << 20
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"


class S3Store(ObjectStore):
    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint: str | None,
        env: Mapping[str, str],
        part_size: int = 16 * MiB,
        parallelism: int = 8,
        retry: RetryPolicy | None = None,
        check_bucket: bool = True,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self.prefix}"
        self.part_size = max(5 * MiB, part_size)
        self.parallelism = max(1, parallelism)
        self.retry = retry or RetryPolicy()

        endpoint = endpoint or env.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise KilnError(f"checkpoint.endpoint {endpoint!r} is not a URL; use e.g. http://minio.minio.svc:9000")
        self.endpoint = f"{parsed.scheme}://{parsed.netloc}"
        access, secret = env.get(ACCESS_KEY_ENV), env.get(SECRET_KEY_ENV)
        if not access or not secret:
            raise KilnError(
                f"no S3 credentials for {self.endpoint} ({self.uri}): set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} in the "
                "environment (on Kubernetes: checkpoint.credentialsSecret names a Secret with those keys)"
            )
        # No retries inside urllib3: call_with_retry owns the schedule, so a server that is down for a
        # minute is waited out with backoff and a warning instead of five quick failures.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5.0, read=120.0),
            maxsize=self.parallelism * 2,
            retries=urllib3.Retry(total=0, redirect=3, raise_on_redirect=False),
            block=True,
        )
        self.client = Minio(
            parsed.netloc,
            access_key=access,
            secret_key=secret,
            session_token=env.get("AWS_SESSION_TOKEN"),
            secure=parsed.scheme == "https",
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            http_client=http,
        )
        if check_bucket and not self._call(lambda: self.client.bucket_exists(bucket), "check bucket"):
            raise KilnError(f"S3 bucket {bucket!r} does not exist at {self.endpoint}; create it or fix checkpoint.uri")

    # -- plumbing -------------------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _classify(self, err: BaseException, key: str | None = None) -> None:
        if isinstance(err, S3Error):
            if err.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound") and key is not None:
                raise ObjectNotFound(f"{self.url(key)} does not exist") from None
            if err.code in PERMANENT_S3_CODES:
                raise KilnError(
                    f"S3 {self.endpoint}, bucket {self.bucket!r}: {PERMANENT_S3_CODES[err.code]} ({err.code})"
                ) from None

    def _call(self, fn, what: str, key: str | None = None):
        return call_with_retry(
            fn,
            what=f"S3 {what} {self.url(key) if key else self.uri} at {self.endpoint}",
            policy=self.retry,
            classify=lambda err: self._classify(err, key),
        )

    # -- the interface ---------------------------------------------------------------------------------------

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        size = os.path.getsize(path)
        # Parts of at least part_size, at most 10,000 of them (the S3 limit); minio uploads them in parallel.
        part = max(self.part_size, math.ceil(size / 10_000 / MiB) * MiB)
        self._call(
            lambda: self.client.fput_object(
                self.bucket, self._name(key), os.fspath(path), part_size=part, num_parallel_uploads=self.parallelism
            ),
            "upload",
            key,
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(
            lambda: self.client.put_object(self.bucket, self._name(key), io.BytesIO(data), len(data)), "upload", key
        )

    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""

        def fetch() -> bytes:
            resp = self.client.get_object(self.bucket, self._name(key), offset=offset, length=length or 0)
            try:
                return resp.read()  # inside the retry: a connection dropped mid-body is retried too
            finally:
                resp.close()
                resp.release_conn()

        return self._call(fetch, "download", key)

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Parallel ranged GETs written at their offsets; each range is retried on its own."""
        size = self.size(key)
        chunk = self.part_size
        with open(path, "wb") as f:
            f.truncate(size)
        fd = os.open(path, os.O_WRONLY)
        try:

            def one(offset: int) -> None:
                data = self.get_bytes(key, offset, min(chunk, size - offset))
                os.pwrite(fd, data, offset)

            with ThreadPoolExecutor(self.parallelism) as pool:
                list(pool.map(one, range(0, size, chunk)))
        finally:
            os.close(fd)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several (offset, length) ranges of one object, fetched in parallel."""
        with ThreadPoolExecutor(self.parallelism) as pool:
            return list(pool.map(lambda r: self.get_bytes(key, r[0], r[1]), ranges))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def fetch():
            return [
                ObjectInfo(o.object_name[len(self.prefix) :], o.size or 0)
                for o in self.client.list_objects(self.bucket, prefix=self._name(prefix), recursive=True)
                if not o.is_dir
            ]

        return sorted(self._call(fetch, "list", prefix), key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self._call(lambda: self.client.remove_object(self.bucket, self._name(key)), "delete", key)

    def size(self, key: str) -> int:
        return int(self._call(lambda: self.client.stat_object(self.bucket, self._name(key)).size, "stat", key))
