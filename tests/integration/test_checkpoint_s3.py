"""Checkpoints on a real S3 server: the rig's (versitygw), and for the outage test a private one started from
the rig's versitygw build so that stopping it does not disturb other tests using the rig."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import ObjectNotFound, open_store
from kiln.storage.commit import committed_steps
from kiln.storage.retry import RetryPolicy
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from tests.support.ranks import SAFETY_TIMEOUT_S, wait_until
from tests.support.s3 import ACCESS, SECRET, PrivateS3

MiB = 1 << 20


class DroppingProxy:
    """A TCP proxy in front of a real S3 server that resets the connection carrying the first request whose
    request line matches `drop` (a real dropped connection, mid-upload), and counts the requests it saw."""

    REQUEST = re.compile(rb"(?:PUT|POST) /[^ ?]*\?(uploads|partNumber=(\d+))")

    def __init__(self, upstream: str, drop: bytes):
        url = urllib.parse.urlparse(upstream)
        self.upstream = (url.hostname, url.port)
        self.drop = re.compile(drop)
        self.dropped = 0
        self.seen: collections.Counter = collections.Counter()  # "uploads" / part number → requests
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while data := src.recv(1 << 16):
                if requests:
                    window = tail + data
                    for m in self.REQUEST.finditer(window):
                        if m.end() > len(tail):  # not counted with the previous chunk
                            with self.lock:
                                self.seen[m.group(2).decode() if m.group(2) else "uploads"] += 1
                    with self.lock:
                        drop = not self.dropped and self.drop.search(window) is not None
                        self.dropped += drop
                    if drop:  # RST both ways, as a crashed load balancer or a network blip would
                        for s in (src, dst):
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                            s.close()
                        return
                    tail = window[-200:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def private_s3(tmp_path):
    data = tmp_path / "s3-data"
    (data / "ckpt").mkdir(parents=True)  # the posix backend: a bucket is a directory
    server = PrivateS3(data)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def rig_env(rig, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rig.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rig.s3_secret_key)
    return {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}


@pytest.fixture
def rig_uri(rig, rig_env):
    uri = f"s3://{rig.s3_bucket}/test-ckpt/{uuid.uuid4().hex}/"
    yield uri
    open_store(uri, endpoint=rig.s3_endpoint, env=rig_env).delete_prefix("")


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, i):
    opt.zero_grad()
    model(torch.full((2, 64), float(i))).square().mean().backward()
    opt.step()


@pytest.mark.rig
def test_s3_store_multipart_ranged_list_delete(rig, rig_env, rig_uri, tmp_path):
    store = open_store(rig_uri, endpoint=rig.s3_endpoint, env=rig_env, part_size=5 * MiB, parallelism=4)
    data = os.urandom(12 * MiB + 12345)  # three parts, uploaded in parallel
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.put_file("step-00000001/big.bin", src)
    store.put_bytes("step-00000001/small", b"hello")
    assert store.size("step-00000001/big.bin") == len(data)
    assert [(o.key, o.size) for o in store.list("step-")] == [
        ("step-00000001/big.bin", len(data)),
        ("step-00000001/small", 5),
    ]
    dst = tmp_path / "back.bin"
    store.get_file("step-00000001/big.bin", dst)  # ranged GETs in parallel
    assert dst.read_bytes() == data
    assert store.get_bytes("step-00000001/big.bin", 7 * MiB, 100) == data[7 * MiB : 7 * MiB + 100]
    with pytest.raises(ObjectNotFound, match="step-00000001/missing"):
        store.size("step-00000001/missing")
    assert store.delete_prefix("step-00000001/") == 2
    assert store.list() == []


@pytest.mark.rig
def test_a_dropped_connection_retries_only_that_part(rig, rig_env, rig_uri, caplog):
    """Part 2 of 4 loses its connection once: that part is sent again, the upload is not restarted, the object
    is whole, and the retry is logged with the part number."""
    proxy = DroppingProxy(rig.s3_endpoint, drop=rb"\?partNumber=2&")
    try:
        store = open_store(
            rig_uri,
            endpoint=proxy.endpoint,
            env=rig_env,
            part_size=5 * MiB,
            parallelism=2,
            retry=RetryPolicy(initial_s=0.05, max_delay_s=0.5, budget_s=30),
        )
        data = os.urandom(17 * MiB)  # parts of 5, 5, 5 and 2 MiB
        with caplog.at_level(logging.WARNING, logger="kiln.storage"):
            with store.open_writer("obj.bin") as w:
                for off in range(0, len(data), 3 * MiB + 7):  # writes that do not line up with the parts
                    w.write(data[off : off + 3 * MiB + 7])
        assert proxy.dropped == 1
        assert proxy.seen == {"uploads": 1, "1": 1, "2": 2, "3": 1, "4": 1}
        # an object that fits in one part (7 MiB < 16 MiB) is one plain PUT: no multipart round trips
        small = os.urandom(7 * MiB)
        open_store(rig_uri, endpoint=proxy.endpoint, env=rig_env, part_size=16 * MiB).put_bytes("small.bin", small)
        assert proxy.seen == {"uploads": 1, "1": 1, "2": 2, "3": 1, "4": 1}
    finally:
        proxy.close()
    direct = open_store(rig_uri, endpoint=rig.s3_endpoint, env=rig_env)  # what the server holds
    assert direct.get_bytes("obj.bin") == data and direct.get_bytes("small.bin") == small
    retries = [r.message for r in caplog.records if "retry" in r.message]
    assert len(retries) == 1 and "upload part 2 of" in retries[0] and "obj.bin" in retries[0]


@pytest.mark.rig
def test_a_failed_streamed_upload_leaves_nothing(rig, rig_env, rig_uri):
    """An exception while the object is being written aborts the upload: the key never appears."""
    store = open_store(rig_uri, endpoint=rig.s3_endpoint, env=rig_env, part_size=5 * MiB)
    with pytest.raises(RuntimeError, match="serialiser failed"):
        with store.open_writer("half.bin") as w:
            w.write(os.urandom(11 * MiB))  # two parts already uploaded
            raise RuntimeError("serialiser failed")
    assert not store.exists("half.bin")
    uploads = store.client._list_multipart_uploads(store.bucket, prefix=store.prefix)
    assert [u.object_name for u in uploads.uploads] == []


@pytest.mark.rig
def test_s3_permanent_errors_name_endpoint_and_bucket(rig, rig_env):
    bad = {**rig_env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    with pytest.raises(KilnError) as err:
        open_store(f"s3://{rig.s3_bucket}/x/", endpoint=rig.s3_endpoint, env=bad)
    assert rig.s3_endpoint in str(err.value) and rig.s3_bucket in str(err.value)
    assert "AWS_SECRET_ACCESS_KEY" in str(err.value) or "credentials" in str(err.value)
    with pytest.raises(KilnError) as err:
        open_store("s3://no-such-bucket-kiln/x/", endpoint=rig.s3_endpoint, env=rig_env)
    assert "no-such-bucket-kiln" in str(err.value) and "does not exist" in str(err.value)


@pytest.mark.rig
def test_checkpoint_round_trip_and_flipped_byte_on_s3(rig, rig_env, rig_uri, caplog):
    model, opt = _model()
    spec = CheckpointSpec(uri=rig_uri, endpoint=rig.s3_endpoint, interval_steps=1, keep=3)
    ck = Checkpointer(spec, default_uri="", rank=0, world_size=1)
    want = {}
    for i in (1, 2):
        _step(model, opt, i)
        want[i] = [p.detach().clone() for p in model.parameters()]
        ck.save(i, [model], [opt], {"step": i})
    ck.close()

    store = ck.store
    assert committed_steps(store) == [2, 1]
    assert store.get_bytes("latest") == b"step-00000002\n"
    shard = next(o.key for o in store.list("step-00000002/") if o.key.endswith(".distcp"))
    blob = bytearray(store.get_bytes(shard))
    blob[len(blob) // 3] ^= 0x80
    store.put_bytes(shard, bytes(blob))  # same size, one bit different

    fresh, fopt = _model()
    with caplog.at_level(logging.WARNING, logger="kiln.checkpoint"):
        state = Checkpointer(spec, default_uri="", rank=0, world_size=1).restore([fresh], [fopt])
    assert state["step"] == 1
    for a, b in zip(fresh.parameters(), want[1]):
        assert torch.equal(a, b)
    assert any("step 2" in r.message and "sha256" in r.message for r in caplog.records)


def test_s3_outage_mid_save_is_retried_and_nothing_committed_is_lost(private_s3, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    uri = "s3://ckpt/run/"
    spec = CheckpointSpec(uri=uri, endpoint=private_s3.endpoint, interval_steps=1)
    store = open_store(
        uri, endpoint=private_s3.endpoint, retry=RetryPolicy(initial_s=0.1, max_delay_s=1.0, budget_s=SAFETY_TIMEOUT_S)
    )  # the budget: a safety net; the store comes back once an upload has failed
    ck = Checkpointer(spec, default_uri="", rank=0, world_size=1, store=store)
    model, opt = _model()
    _step(model, opt, 1)
    ck.save(1, [model], [opt], {"step": 1})
    ck.wait()

    _step(model, opt, 2)
    want = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="kiln.storage"):
        private_s3.stop()  # the server goes away as the save starts uploading
        ck.save(2, [model], [opt], {"step": 2})
        # training continues while the store is down: save returned and the steps ran with step 2 not yet
        # committed (the store comes back only below), so the loop did not wait for the upload
        for i in range(3, 6):
            _step(model, opt, i)
        assert ck.stats.last_committed_step == 1
        retries = lambda: [r.message for r in caplog.records  # noqa: E731
                           if r.name == "kiln.storage" and "retry" in r.message]
        wait_until("an upload retried while the store is down", retries)
        private_s3.start()
        ck.wait()
    assert ck.stats.save_failures == 0 and ck.stats.last_committed_step == 2
    assert private_s3.endpoint in retries()[0]

    assert committed_steps(store) == [2, 1]
    fresh, fopt = _model()
    assert Checkpointer(spec, default_uri="", rank=0, world_size=1, store=store).restore([fresh], [fopt])["step"] == 2
    for a, b in zip(fresh.parameters(), want):
        assert torch.equal(a, b)
    ck.close()
