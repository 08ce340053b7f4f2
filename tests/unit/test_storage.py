"""The object-store layer: file:// semantics, URI and credential errors, retry classification and backoff."""

from __future__ import annotations

import errno
import logging
import ssl

import pytest
import urllib3
from kiln.errors import KilnError
from kiln.storage import FileStore, ObjectNotFound, open_store
from kiln.storage.retry import RetryPolicy, call_with_retry, is_transient

from tests.store_wrappers import PassThroughStore


def test_file_store_round_trip(tmp_path):
    store = open_store(f"file://{tmp_path}/ckpt/")
    assert isinstance(store, FileStore)
    store.put_bytes("step-1/a.bin", b"0123456789")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    store.put_file("step-1/sub/b.bin", src)
    store.put_bytes("step-2/c.bin", b"c")
    store.put_bytes("latest", b"step-2\n")

    assert store.get_bytes("step-1/a.bin") == b"0123456789"
    assert store.get_bytes("step-1/a.bin", 3, 4) == b"3456"
    assert store.size("step-1/sub/b.bin") == 1000
    assert [o.key for o in store.list("step-1/")] == ["step-1/a.bin", "step-1/sub/b.bin"]
    assert [o.key for o in store.list("step-")] == ["step-1/a.bin", "step-1/sub/b.bin", "step-2/c.bin"]
    assert [o.key for o in store.list()] == ["latest", "step-1/a.bin", "step-1/sub/b.bin", "step-2/c.bin"]
    dst = tmp_path / "dst.bin"
    store.get_file("step-1/sub/b.bin", dst)
    assert dst.read_bytes() == b"x" * 1000

    assert store.delete_prefix("step-1/") == 2
    assert not store.exists("step-1/a.bin")
    assert not (tmp_path / "ckpt" / "step-1").exists()  # empty directories go too
    store.delete("step-1/a.bin")  # deleting twice is fine
    # no temporary files are left behind by the atomic writes
    assert not [p for p in (tmp_path / "ckpt").rglob("*.tmp")]


class WrappedStore(PassThroughStore):
    """A store wrapper (as tests and tools write them) that does not override open_writer."""


@pytest.mark.parametrize("backend", ["file", "default"])
def test_a_streamed_write_appears_whole_or_not_at_all(tmp_path, backend):
    """open_writer: the key holds every byte once the block exits; if the block raises, the key (and any old
    value) is untouched. `default` is ObjectStore's spool-then-put_file version, used by store wrappers."""
    store = FileStore(tmp_path / "ckpt")
    if backend == "default":
        store = WrappedStore(store)
    store.put_bytes("k", b"old")
    with pytest.raises(RuntimeError, match="serialiser"):
        with store.open_writer("k") as f:
            f.write(b"new, but never finished")
            raise RuntimeError("serialiser failed")
    assert store.get_bytes("k") == b"old"
    with store.open_writer("k") as f:
        for i in range(100):
            f.write(bytes([i]) * 1000)
        assert store.get_bytes("k") == b"old"  # readers see the old value until the write completes
    assert store.get_bytes("k") == b"".join(bytes([i]) * 1000 for i in range(100))
    assert not [p for p in (tmp_path / "ckpt").rglob("*.tmp")]


def test_file_store_listing_skips_an_object_deleted_during_the_walk(tmp_path, monkeypatch):
    """Retention deletes old steps while another rank lists: the listing must not fail on the vanished file."""
    import kiln.storage.store as store_module

    store = FileStore(str(tmp_path))
    store.put_bytes("step-1/COMMIT", b"{}")
    store.put_bytes("step-2/COMMIT", b"{}")
    real_walk = store_module.os.walk

    def walk_then_delete(top):
        for dirpath, dirs, files in real_walk(top):
            if "COMMIT" in files and dirpath.endswith("step-1"):
                (tmp_path / "step-1" / "COMMIT").unlink()  # deleted after the walk named it
            yield dirpath, dirs, files

    monkeypatch.setattr(store_module.os, "walk", walk_then_delete)
    assert [o.key for o in store.list("step-")] == ["step-2/COMMIT"]


def test_file_store_missing_key_and_bad_key(tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(ObjectNotFound, match="nope"):
        store.get_bytes("nope")
    with pytest.raises(ObjectNotFound):
        store.size("nope")
    assert not store.exists("nope")
    with pytest.raises(KilnError, match="'..'"):
        store.put_bytes("../escape", b"x")


@pytest.mark.parametrize(
    ("uri", "needle"),
    [
        ("gs://bucket/x", "unknown scheme 'gs'"),
        ("/plain/path", r"unknown scheme '\(none\)'"),
        ("s3:///no-bucket", "name a bucket"),
        ("file://host/path", "absolute path"),
    ],
)
def test_bad_uris_name_the_cause(uri, needle):
    with pytest.raises(KilnError, match=needle) as err:
        open_store(uri, env={})
    assert uri in str(err.value)


def test_s3_without_credentials_names_the_variables():
    with pytest.raises(KilnError) as err:
        open_store("s3://bucket/prefix/", endpoint="http://127.0.0.1:1", env={})
    msg = str(err.value)
    assert "AWS_ACCESS_KEY_ID" in msg and "AWS_SECRET_ACCESS_KEY" in msg and "http://127.0.0.1:1" in msg


def test_s3_endpoint_must_be_a_url():
    with pytest.raises(KilnError, match="ftp://x"):
        open_store("s3://b/", endpoint="ftp://x", env={"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"})


def test_unreachable_endpoint_is_retried_then_named(caplog):
    """Nothing listens on the port: connection refused is transient, so it is retried with warnings, then
    surfaces as a KilnError naming the endpoint."""
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    with caplog.at_level(logging.WARNING, logger="kiln.storage"), pytest.raises(KilnError) as err:
        open_store(
            "s3://bucket/p/",
            endpoint="http://127.0.0.1:9",
            env=env,
            retry=RetryPolicy(initial_s=0.01, max_delay_s=0.05, budget_s=0.3),
        )
    assert "127.0.0.1:9" in str(err.value) and "still failing" in str(err.value)
    assert any("retry" in r.message for r in caplog.records)


def test_transient_classification():
    assert is_transient(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.ECONNRESET, "reset"))
    assert not is_transient(ValueError("bad"))
    tls = urllib3.exceptions.MaxRetryError(None, "https://s3", reason=urllib3.exceptions.SSLError(ssl.SSLError("cert")))
    assert not is_transient(tls)  # a certificate problem is reported at once, not retried for minutes
    assert is_transient(urllib3.exceptions.MaxRetryError(None, "http://s3", reason=ConnectionRefusedError()))
    assert not is_transient(FileNotFoundError("x"))


def test_call_with_retry_retries_transient_then_succeeds(caplog):
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return "ok"

    with caplog.at_level(logging.WARNING, logger="kiln.storage"):
        assert call_with_retry(flaky, what="upload x", policy=RetryPolicy(), sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2
    assert sleeps[1] > sleeps[0] * 0.5  # backoff grows (with jitter)
    assert sum("upload x failed" in r.message for r in caplog.records) == 2


def test_call_with_retry_does_not_retry_permanent_errors():
    calls = []

    def bad():
        calls.append(1)
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        call_with_retry(bad, what="x", policy=RetryPolicy(), sleep=lambda s: None)
    assert len(calls) == 1

    def classify(err):
        raise KilnError("bucket missing")

    with pytest.raises(KilnError, match="bucket missing"):
        call_with_retry(
            lambda: (_ for _ in ()).throw(ConnectionResetError()),
            what="x",
            policy=RetryPolicy(),
            classify=classify,
            sleep=lambda s: None,
        )


def test_backoff_is_bounded():
    policy = RetryPolicy(initial_s=0.5, max_delay_s=4.0)
    delays = [policy.delay(a) for a in range(12)]
    assert all(0.25 <= d <= 4.0 for d in delays)
    assert max(delays[6:]) > 2.0
