"""Restore from the rig's S3 at the same world size (real gloo ranks, FSDP2): every rank downloads its own
shards once, checks them and loads those bytes; a damaged shard of one rank sends every rank to the
previous commit."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.storage import ObjectStore, open_store
from tests.store_wrappers import PassThroughStore
from tests.support.ranks import fsdp_per_layer, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.rig]

WORLD = 2
WIDTH = 256


class ReadCountingStore(PassThroughStore):
    """The real store, counting the bytes read from each key (to show each shard is downloaded once)."""

    def __init__(self, inner: ObjectStore):
        super().__init__(inner)
        self.read: Counter = Counter()
        self._lock = threading.Lock()

    def get_bytes(self, key, offset=0, length=None):
        data = self.inner.get_bytes(key, offset, length)
        with self._lock:
            self.read[key] += len(data)
        return data

    def get_file(self, key, path):
        raise AssertionError("restore reads through get_bytes")


def _worker(rank: int, world: int, action: str, uri: str, env: dict, out: str) -> dict:
    os.environ.update(env)
    logging.basicConfig(filename=f"{out}/log-{rank}.txt", level=logging.INFO, force=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from kiln.trainer.checkpoint.checkpointer import Checkpointer

    torch.manual_seed(7 if action == "save" else 99)  # a restore starts from other weights
    model = fsdp_per_layer(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    store = ReadCountingStore(open_store(uri))
    ck = Checkpointer(CheckpointSpec(uri=uri, keep=3), default_uri="", rank=rank, world_size=world, store=store)
    result: dict = {}
    weights = {}
    if action == "save":
        for step in (1, 2):
            model(torch.randn(4, WIDTH)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, [model], [opt], {"step": step})
            ck.wait()
            weights[step] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        result["step"] = ck.restore([model], [opt])["step"]
        weights[0] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        result["read"] = dict(store.read)
    ck.close()
    if rank == 0:
        torch.save(weights, f"{out}/weights.pt")
    return result


def _run(action: str, uri: str, env: dict, out: Path) -> list[dict]:
    return run_ranks(_worker, WORLD, out, action, uri, env, str(out))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_rank_reads_its_shards_once_and_a_damaged_one_falls_back_everywhere(rig, tmp_path):
    env = {
        "AWS_ACCESS_KEY_ID": rig.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key,
        "AWS_ENDPOINT_URL": rig.s3_endpoint,
    }
    uri = f"s3://{rig.s3_bucket}/test-ckpt-restore/{uuid.uuid4().hex}/"
    store = open_store(uri, env=env)
    try:
        _run("save", uri, env, tmp_path / "save")
        saved = torch.load(tmp_path / "save" / "weights.pt")
        sizes = {o.key: o.size for o in store.list("step-00000002/")}

        results = _run("restore", uri, env, tmp_path / "restore")
        assert _same(torch.load(tmp_path / "restore" / "weights.pt")[0], saved[2])
        for rank, r in enumerate(results):
            assert r["step"] == 2
            own = {k: n for k, n in sizes.items() if Path(k).name.startswith(f"__{rank}_")}
            assert own, sizes
            for key, size in own.items():  # downloaded exactly once: checked and loaded from the same bytes
                assert r["read"].get(key) == size, (rank, key, r["read"])

        # one byte of rank 1's shard flips: rank 1 finds it, and both ranks load step 1 instead
        shard = next(k for k in sorted(sizes) if Path(k).name.startswith("__1_"))
        blob = bytearray(store.get_bytes(shard))
        blob[len(blob) // 2] ^= 0x01
        store.put_bytes(shard, bytes(blob))
        results = _run("restore", uri, env, tmp_path / "fallback")
        assert [r["step"] for r in results] == [1, 1]
        assert _same(torch.load(tmp_path / "fallback" / "weights.pt")[0], saved[1])
        log0 = (tmp_path / "fallback" / "log-0.txt").read_text()
        assert "step 2" in log0 and Path(shard).name in log0 and "falling back" in log0
    finally:
        store.delete_prefix("")
