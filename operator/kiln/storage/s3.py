"""S3 / MinIO / any S3-compatible endpoint, through the `minio` client.

Writes stream: `open_writer` cuts the bytes into parts as they are written and uploads each part in the
background while the writer goes on (a multipart upload; one plain PUT when the object fits in one part), so
serialising a checkpoint shard overlaps uploading it and nothing is staged on local disk. Reads are parallel
ranged GETs. Every call — each part on its own — is retried with backoff on transient failures
(kiln.storage.retry) and fails fast, naming the endpoint and bucket, on permanent ones (bad credentials,
missing bucket).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Generator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.credentials.providers import IamAwsProvider, Provider, StaticProvider
from minio.datatypes import Part
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from kiln.errors import KilnError
from kiln.storage.retry import PERMANENT_S3_CODES, RetryPolicy, call_with_retry
from kiln.storage.store import ObjectInfo, ObjectNotFound, ObjectStore

log = logging.getLogger("kiln.storage")

MiB = 1 << 20
MAX_PARTS = 10_000  # the S3 limit on parts per multipart upload
MIN_PART = 5 * MiB  # the S3 minimum for every part but the last
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"


def ambient_credentials(env: Mapping[str, str], endpoint: str, uri: str) -> Provider:
    """Where the S3 keys come from: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN) when set
    (on Kubernetes, from checkpoint.credentialsSecret), else what the pod or machine already has — a web
    identity token (IRSA: AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN), a container credentials endpoint (EKS
    Pod Identity, ECS: AWS_CONTAINER_CREDENTIALS_FULL_URI / _RELATIVE_URI), or the instance metadata service
    (the node's role) — through the minio client's own providers. The ambient chain is asked once here, with
    short timeouts, so a machine without any credentials fails now with this message, not at the first save."""
    access, secret = env.get(ACCESS_KEY_ENV), env.get(SECRET_KEY_ENV)
    if access and secret:
        return StaticProvider(access, secret, env.get("AWS_SESSION_TOKEN"))
    quick = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2.0, read=5.0), retries=urllib3.Retry(total=1))
    provider = IamAwsProvider(http_client=quick)
    try:
        provider.retrieve()
    except Exception as err:  # noqa: BLE001 - every way the chain can fail ends in the one message below
        raise KilnError(
            f"no S3 credentials for {endpoint} ({uri}): {ACCESS_KEY_ENV}/{SECRET_KEY_ENV} are not set and no ambient "
            f"credentials were found (web identity, container credentials endpoint, instance metadata: "
            f"{type(err).__name__}: {str(err)[:200]}); on Kubernetes name a Secret with those keys in "
            "checkpoint.credentialsSecret, or give the run's ServiceAccount (<name>-trainer) an AWS identity"
        ) from None
    return provider


RETRY_BUDGET_ENV = "KILN_STORE_RETRY_SECONDS"  # how long an unreachable store is waited for (RetryPolicy.budget_s)


def retry_budget(env: Mapping[str, str]) -> float:
    text = env.get(RETRY_BUDGET_ENV)
    if text is None:
        return RetryPolicy.budget_s
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise KilnError(f"{RETRY_BUDGET_ENV}={text!r}: give the seconds to wait for the object store, e.g. 300")
    return value


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
        self.part_size = max(MIN_PART, part_size)
        self.parallelism = max(1, parallelism)
        self.retry = retry or RetryPolicy(budget_s=retry_budget(env))
        # Part uploads of every open writer share one pool; `_slots` bounds the parts held in memory (queued or
        # in flight) to `parallelism`, so a writer faster than the network waits instead of buffering more.
        self._pool = ThreadPoolExecutor(self.parallelism, thread_name_prefix="kiln-s3-part")
        self._slots = threading.BoundedSemaphore(self.parallelism)
        self._free: list[bytearray] = []  # part buffers for reuse (fresh ones cost a page fault per 4 KiB)
        self._free_lock = threading.Lock()

        endpoint = endpoint or env.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise KilnError(f"checkpoint.endpoint {endpoint!r} is not a URL; use e.g. http://minio.minio.svc:9000")
        self.endpoint = f"{parsed.scheme}://{parsed.netloc}"
        credentials = ambient_credentials(env, self.endpoint, self.uri)
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
            credentials=credentials,
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

    @contextlib.contextmanager
    def open_writer(self, key: str) -> Generator[MultipartWriter, None, None]:
        writer = MultipartWriter(self, key)
        try:
            yield writer
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        with open(path, "rb") as f, self.open_writer(key) as writer:
            writer.write_from(f)

    def put_bytes(self, key: str, data: bytes) -> None:
        if len(data) > self.part_size:
            with self.open_writer(key) as writer:
                writer.write(data)
            return
        # one PUT (minio would cut anything over 5 MiB into parts of its own, without per-part retry)
        self._call(
            lambda: self.client.put_object(
                self.bucket, self._name(key), io.BytesIO(data), len(data), part_size=max(len(data), MIN_PART)
            ),
            "upload",
            key,
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

    def delete_prefix(self, prefix: str) -> int:
        """One DeleteObjects request per 1000 keys instead of one DELETE each."""
        objects = self.list(prefix)

        def delete() -> None:
            names = [DeleteObject(self._name(o.key)) for o in objects]
            errors = list(self.client.remove_objects(self.bucket, names))
            if errors:
                raise KilnError(f"S3 delete under {self.url(prefix)} at {self.endpoint}: {errors[0]}")

        if objects:
            self._call(delete, "delete", prefix)
        return len(objects)

    def size(self, key: str) -> int:
        return int(self._call(lambda: self.client.stat_object(self.bucket, self._name(key)).size, "stat", key))

    # -- part buffers (MultipartWriter) ---------------------------------------------------------------------

    def _buffer(self) -> bytearray:
        with self._free_lock:
            if self._free:
                return self._free.pop()
        return bytearray(self.part_size)

    def _recycle(self, buf: bytearray) -> None:
        if len(buf) == self.part_size:
            with self._free_lock:
                if len(self._free) < self.parallelism + 2:
                    self._free.append(buf)


class MultipartWriter(io.RawIOBase):
    """A write-only stream that becomes one S3 object: full parts are uploaded in the background as they fill,
    each retried on its own (a dropped connection re-sends that part, not the object). Nothing is visible under
    the key until `finish` completes the upload; `abort` drops the parts. Not thread-safe (one writer thread)."""

    def __init__(self, store: S3Store, key: str):
        self.store, self.key = store, key
        self.name = store._name(key)
        self.pos = 0  # bytes written so far (tell)
        self.buf = store._buffer()
        self.fill = 0
        self.upload_id: str | None = None
        self.parts: list[Future] = []  # part i+1 → its ETag

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        while view:
            take = min(len(view), len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = view[:take]
            self.fill += take
            view = view[take:]
            if self.fill == len(self.buf):
                self._send()
        self.pos += n
        return n

    def write_from(self, f) -> None:
        """Copy a file in, reading straight into the part buffers."""
        while n := f.readinto(memoryview(self.buf)[self.fill :]):
            self.fill += n
            self.pos += n
            if self.fill == len(self.buf):
                self._send()

    def _part_size(self) -> int:
        # Parts grow by part_size every 1000 parts, so MAX_PARTS parts hold 55,000 x part_size (880 GB at 16 MiB).
        return self.store.part_size * (1 + len(self.parts) // 1000)

    def _send(self) -> None:
        """Queue the full buffer as the next part (waits while `parallelism` parts are in memory)."""
        for done in self.parts:
            if done.done() and done.exception() is not None:
                raise done.exception()  # a part failed for good: stop serialising into a dead upload
        if len(self.parts) >= MAX_PARTS:
            raise KilnError(f"{self.store.url(self.key)}: more than {MAX_PARTS} parts; raise the part size")
        st = self.store
        if self.upload_id is None:
            self.upload_id = st._call(
                lambda: st.client._create_multipart_upload(st.bucket, self.name, {}), "start upload", self.key
            )
        data, number, upload_id = self.buf, len(self.parts) + 1, self.upload_id
        st._slots.acquire()
        try:
            fut = st._pool.submit(self._upload_part, data, self.fill, number, upload_id)
        except BaseException:
            st._slots.release()
            raise
        self.parts.append(fut)
        size = self._part_size()
        self.buf = st._buffer() if size == st.part_size else bytearray(size)
        self.fill = 0

    def _upload_part(self, data: bytearray, length: int, number: int, upload_id: str) -> str:
        st = self.store
        body = data if length == len(data) else bytes(data[:length])
        try:
            return st._call(
                lambda: st.client._upload_part(st.bucket, self.name, body, None, upload_id, number),
                f"upload part {number} of",
                self.key,
            )
        finally:
            st._recycle(data)
            st._slots.release()

    def finish(self) -> None:
        st = self.store
        if self.upload_id is None:  # it fits in one part: a plain PUT, no multipart round trips
            st.put_bytes(self.key, bytes(self.buf[: self.fill]))
            st._recycle(self.buf)
            return
        if self.fill:
            self._send()
        st._recycle(self.buf)  # the empty buffer _send left for a next part
        parts = [Part(i + 1, fut.result()) for i, fut in enumerate(self.parts)]
        st._call(
            lambda: st.client._complete_multipart_upload(st.bucket, self.name, self.upload_id, parts),
            "complete upload",
            self.key,
        )

    def abort(self) -> None:
        """Drop what was uploaded (one attempt: this runs after a failure, often with the server away)."""
        for fut in self.parts:
            if fut.cancel():  # never ran: its slot is ours to give back
                self.store._slots.release()
        for fut in self.parts:
            with contextlib.suppress(BaseException):
                fut.result()
        if self.upload_id is not None:
            try:
                self.store.client._abort_multipart_upload(self.store.bucket, self.name, self.upload_id)
            except Exception as err:  # noqa: BLE001 - the incomplete upload only costs space until cleaned up
                log.warning("S3 could not abort the upload of %s (%s)", self.store.url(self.key), err)
