"""Token shards from the rig's S3 into a pod's data cache: refused before any download when they cannot fit
the pod's disk budget, fetched once per node otherwise."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.storage import open_store
from kiln.trainer.data.loader import fetch_shards

pytestmark = pytest.mark.rig

MiB = 1 << 20


@pytest.fixture
def shards(rig, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rig.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rig.s3_secret_key)
    uri = f"s3://{rig.s3_bucket}/data-cache/{uuid.uuid4().hex}/"
    store = open_store(uri, endpoint=rig.s3_endpoint)
    for i in range(2):
        path = tmp_path / f"{i:03d}.npy"
        np.save(path, np.arange(MiB // 2, dtype=np.uint16))  # 1 MiB of tokens + the .npy header
        store.put_file(path.name, path)
    yield uri
    store.delete_prefix("")


def test_shards_beyond_the_pods_disk_budget_are_refused_before_any_download(rig, shards, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_DATA_CACHE_BYTES", str(int(1.5 * MiB)))  # what the operator sets from the limit
    with pytest.raises(KilnError, match=r"need 0\.0 GiB more .* raise resources.ephemeralStorage"):
        fetch_shards(shards, endpoint=rig.s3_endpoint, cache_root=str(cache))
    assert not [p for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]


def test_ranks_of_a_node_fetch_each_shard_once(rig, shards, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_DATA_CACHE_BYTES", str(4 * MiB))
    from kiln.storage.s3 import S3Store

    downloads, real_get_file = [], S3Store.get_file

    def counted_get_file(self, key, path):
        downloads.append(key)
        return real_get_file(self, key, path)

    monkeypatch.setattr(S3Store, "get_file", counted_get_file)
    folders, errors = [], []

    def rank():
        try:
            folders.append(fetch_shards(shards, endpoint=rig.s3_endpoint, cache_root=str(cache)))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    ranks = [threading.Thread(target=rank) for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert not errors and len(set(folders)) == 1
    files = sorted(p.name for p in folders[0].iterdir())
    assert files == ["000.npy", "001.npy"]  # no partial copies left behind
    assert sorted(downloads) == ["000.npy", "001.npy"]  # one copy per node, not one per rank
    stamps = {p.name: p.stat().st_mtime_ns for p in folders[0].iterdir()}
    fetch_shards(shards, endpoint=rig.s3_endpoint, cache_root=str(cache))  # a restart: nothing fetched again
    assert {p.name: p.stat().st_mtime_ns for p in folders[0].iterdir()} == stamps
