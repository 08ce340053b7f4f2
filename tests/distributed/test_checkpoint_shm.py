"""Fast restart from host memory (real gloo processes, FSDP2 at dp=2): a restarted job reads the newest commit
from each rank's copy in shared memory instead of the store, and falls back to the store — on every rank alike —
when a copy is missing, older than the store's newest commit, saved by another world size, or damaged."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.storage import ObjectStore, open_store
from tests.store_wrappers import PassThroughStore
from tests.support.ranks import fsdp_per_layer, run_ranks

pytestmark = [pytest.mark.distributed]

WIDTH = 64
STEPS = 3  # saved steps; the copy in memory must hold only the last


class CountingStore(PassThroughStore):
    """The real store, counting every access to a shard file (*.distcp): a memory restore makes none."""

    def __init__(self, inner: ObjectStore):
        super().__init__(inner)
        self.shard_accesses = 0

    def _count(self, key: str) -> None:
        if key.endswith(".distcp"):
            self.shard_accesses += 1

    def get_file(self, key, path):
        self._count(key)
        self.inner.get_file(key, path)

    def get_bytes(self, key, offset=0, length=None):
        self._count(key)
        return self.inner.get_bytes(key, offset, length)

    def size(self, key):
        self._count(key)
        return self.inner.size(key)

    def local_path(self, key):
        self._count(key)
        return self.inner.local_path(key)


def _worker(rank: int, world: int, action: str, uri: str, shm: str, out: str) -> dict:
    os.environ["KILN_SHM_DIR"] = shm
    logging.basicConfig(filename=f"{out}/log-{rank}.txt", level=logging.INFO, force=True)
    from kiln.trainer.checkpoint.checkpointer import Checkpointer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    torch.manual_seed(1234 if action == "save" else 99)  # a restore starts from other weights
    model = fsdp_per_layer(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    store = CountingStore(open_store(uri))
    ck = Checkpointer(CheckpointSpec(uri=uri, interval_steps=1, keep=3), default_uri="", rank=rank, world_size=world, store=store)
    state = ck.restore([model], [opt]) if action in ("restore", "resume") else None
    result = {"source": ck.last_restore_source, "step": state and state["step"], "shard_accesses": store.shard_accesses}
    if action in ("save", "resume"):
        first = state["step"] + 1 if state else 1
        for step in range(first, first + (STEPS if action == "save" else 1)):
            model(torch.randn(4, WIDTH)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, [model], [opt], {"step": step})
        ck.wait()
        result["step"] = step
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ck.close()
    if rank == 0:
        torch.save(full, f"{out}/weights.pt")
    return result


def _run(world: int, action: str, uri: str, shm: Path, out: Path) -> list[dict]:
    return run_ranks(_worker, world, out, action, uri, str(shm), str(out))


def _weights(out: Path) -> dict:
    return torch.load(out / "weights.pt")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _copies(shm: Path, uri: str) -> Path:
    return shm / hashlib.sha256(uri.encode()).hexdigest()[:16]


def _log(out: Path) -> str:
    return "".join(p.read_text() for p in sorted(out.glob("log-*.txt")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """dp=2 saves steps 1..3 to a file:// store; each rank keeps its copy of step 3 in (tmpfs-like) memory."""
    base = tmp_path_factory.mktemp("shm")
    uri = f"file://{base}/store/"
    _run(2, "save", uri, base / "shm", base / "save")
    return base, uri


def _fresh_shm(saved, name: str) -> Path:
    """A private copy of the saved memory copies (same run, so the same <run> directory name)."""
    base = saved[0]
    shm = base / name
    shutil.copytree(base / "shm", shm)
    return shm


def test_memory_copy_holds_only_the_newest_commit(saved):
    base, uri = saved
    for rank in range(2):
        d = _copies(base / "shm", uri) / f"rank-{rank}"
        assert json.loads((d / "SHM.json").read_text()) == {"step": STEPS, "world_size": 2, "rank": rank}
        shards = [p.name for p in d.iterdir() if p.suffix == ".distcp"]
        assert shards and all(name.startswith(f"__{rank}_") for name in shards)  # this rank's shards only
    assert sorted(p.name for p in _copies(base / "shm", uri).iterdir()) == ["rank-0", "rank-1"]  # no leftovers


def test_restart_reads_memory_not_the_store(saved):
    base, uri = saved
    out = base / "restore-memory"
    results = _run(2, "restore", uri, _fresh_shm(saved, "shm-memory"), out)
    assert [r["source"] for r in results] == ["memory", "memory"]
    assert [r["step"] for r in results] == [STEPS, STEPS]
    assert [r["shard_accesses"] for r in results] == [0, 0]  # not one shard read from the store
    assert _same(_weights(out), _weights(base / "save"))


def test_missing_copy_on_one_rank_sends_every_rank_to_the_store(saved):
    base, uri = saved
    shm = _fresh_shm(saved, "shm-missing")
    shutil.rmtree(_copies(shm, uri) / "rank-1")
    out = base / "restore-missing"
    results = _run(2, "restore", uri, shm, out)
    assert [r["source"] for r in results] == [uri, uri]
    assert all(r["shard_accesses"] > 0 for r in results)
    assert _same(_weights(out), _weights(base / "save"))
    assert "rank 1: no copy" in _log(out)


def test_damaged_copy_falls_back_to_the_store_with_a_warning(saved):
    base, uri = saved
    shm = _fresh_shm(saved, "shm-damaged")
    shard = _copies(shm, uri) / "rank-0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = base / "restore-damaged"
    results = _run(2, "restore", uri, shm, out)
    assert [r["source"] for r in results] == [uri, uri]
    assert _same(_weights(out), _weights(base / "save"))
    log = _log(out)
    assert "WARNING" in log and "__0_0.distcp sha256 does not match COMMIT" in log


def test_other_world_size_reads_the_store(saved):
    base, uri = saved
    out = base / "restore-world1"
    results = _run(1, "restore", uri, _fresh_shm(saved, "shm-world1"), out)
    assert results[0]["source"] == uri and results[0]["step"] == STEPS
    assert _same(_weights(out), _weights(base / "save"))
    assert "saved by 2 ranks, this job has 1" in _log(out)


def test_copy_older_than_the_newest_commit_reads_the_store(saved, tmp_path):
    base, _ = saved
    uri = f"file://{tmp_path}/store/"
    shutil.copytree(base / "store", tmp_path / "store")
    shm = tmp_path / "shm"
    shutil.copytree(_copies(base / "shm", saved[1]), _copies(shm, uri))  # the memory copies of step 3
    _run(2, "resume", uri, tmp_path / "elsewhere", tmp_path / "resume")  # another node commits step 4
    out = tmp_path / "restore"
    results = _run(2, "restore", uri, shm, out)
    assert [(r["source"], r["step"]) for r in results] == [(uri, STEPS + 1)] * 2
    assert _same(_weights(out), _weights(tmp_path / "resume"))
    assert f"holds step {STEPS}, the newest commit is {STEPS + 1}" in _log(out)
