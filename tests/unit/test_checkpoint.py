"""The Checkpointer in one process on file://: round trip, damaged commits, retention, interval, SIGTERM."""

from __future__ import annotations

import collections
import json
import logging
import os
import signal

import pytest
import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.errors import KilnError
from kiln.storage import FileStore
from kiln.storage.bounded import LIMITS
from kiln.storage.commit import committed_steps
from kiln.trainer.checkpoint import checkpointer as ckpt_mod
from kiln.trainer.checkpoint import restore as checkpoint_restore
from kiln.trainer.checkpoint.checkpointer import AUTO_FIRST_STEPS, AUTO_MAX_STEPS, AUTO_MIN_STEPS, Checkpointer
from tests.forged_checkpoints import forge


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    return params, state


def assert_same(model, opt, snap):
    params, state = snapshot(model, opt)
    for a, b in zip(params, snap[0]):
        assert torch.equal(a, b)
    assert state.keys() == snap[1].keys()
    for k in state:
        for n in state[k]:
            assert torch.equal(state[k][n], snap[1][k][n]), (k, n)


def checkpointer(root, **spec):
    return Checkpointer(CheckpointSpec(uri=f"file://{root}", **spec), default_uri="", rank=0, world_size=1)


def run(root, steps, **spec):
    """Train `steps` steps saving per the spec; returns the snapshots taken at each saved step."""
    model, opt = make()
    ck = checkpointer(root, **spec)
    snaps = {}
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        if ck.should_save(step):
            snaps[step] = snapshot(model, opt)
            ck.save(step, [model], [opt], {"step": step, "cursor": step * 4})
    ck.close()
    return snaps


def test_round_trip_restores_weights_optimizer_and_trainer_state(tmp_path):
    snaps = run(tmp_path, 6, interval_steps=3)
    assert committed_steps(checkpointer(tmp_path).store) == [6, 3]
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"
    commit = json.loads((tmp_path / "step-00000006" / "COMMIT").read_text())
    assert set(commit["files"]) == {
        ".metadata",
        "trainer.json",
        *(p.name for p in (tmp_path / "step-00000006").glob("*.distcp")),
    }

    model, opt = make(seed=1)  # different initial weights, no optimizer state yet
    state = checkpointer(tmp_path).restore([model], [opt])
    assert state["step"] == 6 and state["cursor"] == 24 and state["kiln"]["world_size"] == 1
    assert_same(model, opt, snaps[6])


def test_a_resume_names_the_commit_its_step_uri_and_age(tmp_path):
    run(tmp_path, 6, interval_steps=3)
    committed_at = json.loads((tmp_path / "step-00000006" / "COMMIT").read_text())["time"]
    model, opt = make(seed=1)
    ck = checkpointer(tmp_path)
    ck.restore([model], [opt])
    assert ck.resume_line(now=committed_at + 150) == \
        f"kiln: resumed from step 6 at file://{tmp_path}/step-00000006 (committed 2m ago)"


def test_no_checkpoint_restores_nothing(tmp_path):
    model, opt = make()
    before = snapshot(model, opt)
    assert checkpointer(tmp_path / "empty").restore([model], [opt]) is None
    assert_same(model, opt, before)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_newest_commit_falls_back_to_the_previous(tmp_path, caplog, damage):
    snaps = run(tmp_path, 4, interval_steps=2)
    shard = sorted((tmp_path / "step-00000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # same size: only the sha256 can tell
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-1]))
    else:
        shard.unlink()

    assert_falls_back_to_step_2(tmp_path, caplog, snaps, shard.name)


def assert_falls_back_to_step_2(root, caplog, snaps, named: str) -> None:
    """Restoring from `root` skips the damaged step 4 with a warning naming `named` and restores step 2."""
    model, opt = make(seed=1)
    with caplog.at_level(logging.WARNING, logger="kiln.checkpoint"):
        state = checkpointer(root).restore([model], [opt])
    assert state["step"] == 2
    assert_same(model, opt, snaps[2])
    warning = " ".join(r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert "step 4" in warning and named in warning and "falling back" in warning


@pytest.mark.parametrize("damage", ["nested 200k deep", "over its size cap", "not JSON", "wrong shape",
                                    "trainer.json nested 200k deep"])
def test_a_commit_that_does_not_parse_falls_back_to_the_previous(tmp_path, caplog, damage):
    """Issue 28: a COMMIT (or the trainer.json it covers) that raises anything while parsing is a damaged commit,
    as a truncated shard is: rank 0 must not crash (losing the run's progress) but restore the previous one."""
    snaps = run(tmp_path, 4, interval_steps=2)
    folder = tmp_path / "step-00000004"
    commit = folder / "COMMIT"
    if damage == "nested 200k deep":
        commit.write_bytes(b"[" * 200_000)
    elif damage == "over its size cap":
        with open(commit, "r+b") as f:
            f.truncate(LIMITS["COMMIT"] + 1)  # sparse
    elif damage == "not JSON":
        commit.write_bytes(b"\xff{")
    elif damage == "wrong shape":
        commit.write_text(json.dumps({"step": 4, "files": {"a": {"size": 1e999, "sha256": "x"}}}))
    else:
        forge(tmp_path, 4, {"trainer.json": b"{" + b'"a":[' * 100_000})  # with a COMMIT that matches it
    named = "trainer.json" if damage.startswith("trainer.json") else "COMMIT"
    assert_falls_back_to_step_2(tmp_path, caplog, snaps, f"step-00000004/{named}")


def test_uncommitted_step_is_never_loaded(tmp_path):
    """A crash after the shards but before COMMIT leaves a newer step directory; resume ignores it."""
    snaps = run(tmp_path, 2, interval_steps=2)
    partial = tmp_path / "step-00000003"
    partial.mkdir()
    for f in (tmp_path / "step-00000002").iterdir():
        if f.name != "COMMIT":
            (partial / f.name).write_bytes(f.read_bytes())
    (tmp_path / "latest").write_text("step-00000003\n")  # even a misleading pointer does not matter
    model, opt = make(seed=1)
    assert checkpointer(tmp_path).restore([model], [opt])["step"] == 2
    assert_same(model, opt, snaps[2])


def test_retention_keeps_the_newest_n_commits(tmp_path):
    run(tmp_path, 10, interval_steps=2, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000008", "step-00000010"]


def test_synchronous_and_final_saves_are_committed_on_return(tmp_path):
    model, opt = make()
    ck = checkpointer(tmp_path, interval_steps=100, async_save=False)
    ck.save(1, [model], [opt], {"step": 1})
    assert (tmp_path / "step-00000001" / "COMMIT").exists()
    ck2 = checkpointer(tmp_path / "b")
    ck2.save(5, [model], [opt], {"step": 5}, final=True)
    assert (tmp_path / "b" / "step-00000005" / "COMMIT").exists()
    assert json.loads((tmp_path / "b" / "step-00000005" / "trainer.json").read_text())["kiln"]["final"] is True
    assert ck2.status()["lastCheckpoint"]["step"] == 5
    ck2.save(5, [model], [opt], {"step": 5}, final=True)  # the same step again is a no-op
    ck.close(), ck2.close()


def test_failed_background_save_is_logged_and_training_continues(tmp_path, caplog):
    model, opt = make()
    ck = checkpointer(tmp_path)
    ck.save(1, [model], [opt], {"step": 1})
    ck.wait()
    # the checkpoint directory becomes unwritable (a file where a directory must go)
    (tmp_path / "step-00000002").write_text("in the way")
    with caplog.at_level(logging.ERROR, logger="kiln.checkpoint"):
        ck.save(2, [model], [opt], {"step": 2})
        ck.wait()
    assert ck.stats.save_failures == 1
    assert any("step 2" in r.message and "last committed step (1)" in r.message for r in caplog.records)
    model2, opt2 = make(seed=3)
    assert checkpointer(tmp_path).restore([model2], [opt2])["step"] == 1
    ck.close()


def test_bad_uri_is_a_kiln_error():
    with pytest.raises(KilnError, match="unknown scheme 'gcs'"):
        Checkpointer(CheckpointSpec(uri="gcs://x/"), default_uri="", rank=0, world_size=1)
    with pytest.raises(KilnError, match="checkpoint.uri is not set"):
        Checkpointer(CheckpointSpec(), default_uri="", rank=0, world_size=1)


def test_default_uri_is_used_when_the_spec_has_none(tmp_path):
    ck = Checkpointer(CheckpointSpec(), default_uri=f"file://{tmp_path}/ck/", rank=0, world_size=1)
    assert ck.store.local_path("x") == tmp_path / "ck" / "x"


def test_interval_fixed_and_auto(tmp_path):
    ck = checkpointer(tmp_path, interval_steps=5)
    assert [s for s in range(0, 21) if ck.should_save(s)] == [5, 10, 15, 20]

    auto = checkpointer(tmp_path / "auto", interval_steps="auto")
    assert auto.schedule.interval_steps == AUTO_FIRST_STEPS  # nothing measured yet: save early to measure
    for s in range(1, 4):
        auto.should_save(s)
    stats, schedule = auto.stats, auto.schedule
    stats.last_saved_step = 3
    schedule.step_time_s, stats.last_save_s = 0.1, 1.0
    stats.last_blocking_s, stats.run_seconds, stats.failures = 0.5, 0.0, 0
    stats.started -= 3600
    relaxed = schedule.interval_steps
    stats.failures = 20  # many restarts → shorter MTBF → save more often
    frequent = schedule.interval_steps
    assert AUTO_MIN_STEPS <= frequent < relaxed <= AUTO_MAX_STEPS
    stats.last_save_s = 50.0  # a background save takes 500 steps: never save faster than that
    assert schedule.interval_steps >= 500
    stats.last_blocking_s = 1e6
    assert schedule.interval_steps == AUTO_MAX_STEPS
    assert auto.status()["intervalSteps"] == AUTO_MAX_STEPS


def test_sigterm_sets_the_stop_flag(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        flag = ckpt_mod.install_sigterm_handler()
        flag.clear()
        ck = checkpointer(tmp_path)
        assert not ck.stop_requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck.stop_requested(2)  # the process is still alive and can save
    finally:
        signal.signal(signal.SIGTERM, previous)
        ckpt_mod._sigterm.clear()


def test_restart_from_a_non_final_checkpoint_counts_as_a_failure(tmp_path):
    run(tmp_path, 2, interval_steps=2)
    model, opt = make()
    ck = checkpointer(tmp_path, interval_steps="auto")
    ck.restore([model], [opt])
    assert ck.stats.failures == 1
    ck.save(3, [model], [opt], {"step": 3}, final=True)
    ck2 = checkpointer(tmp_path)
    ck2.restore([model], [opt])
    assert ck2.stats.failures == 1  # a clean, final save is not a failure


def test_ranged_reader_reads_like_a_file(tmp_path):
    """The S3 read path (block-aligned ranged GETs with read-ahead), driven here through a file store."""
    from kiln.storage import FileStore
    from kiln.trainer.checkpoint.dcp_store import RangedReader

    data = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: 11 blocks of 1000, the last one short
    store = FileStore(tmp_path)
    store.put_bytes("obj", data)
    reader = RangedReader(store, "obj", block=1000, ahead=3)
    assert reader.read(10) == data[:10]
    reader.seek(995)
    assert reader.read(2010) == data[995:3005]  # spans three blocks
    reader.seek(-4, os.SEEK_END)
    assert reader.read() == b"tail" and reader.read(5) == b""
    reader.seek(0)
    assert reader.read() == data
    reader.seek(5000)
    buf = bytearray(100)
    assert reader.readinto(buf) == 100 and bytes(buf) == data[5000:5100] and reader.tell() == 5100
    reader.close()


class RemoteLike(FileStore):
    """A real file store read only through get_bytes (no local path), as S3 is; counts the bytes read."""

    def __init__(self, root):
        super().__init__(root)
        self.read = collections.Counter()

    def local_path(self, key):
        return None

    def get_bytes(self, key, offset=0, length=None):
        data = super().get_bytes(key, offset, length)
        self.read[key] += len(data)
        return data


@pytest.mark.parametrize("memory", ["plenty", "short"])
def test_restore_from_a_remote_store_reads_each_shard_once_or_twice_when_memory_is_short(
    tmp_path, monkeypatch, caplog, memory
):
    snaps = run(tmp_path, 2, interval_steps=2)
    store = RemoteLike(tmp_path)
    if memory == "short":
        monkeypatch.setattr(checkpoint_restore, "memory_available", lambda: 1 << 10)
    model, opt = make(seed=1)
    with caplog.at_level(logging.WARNING, logger="kiln.checkpoint"):
        ck = Checkpointer(CheckpointSpec(uri=f"file://{tmp_path}"), default_uri="", rank=0, world_size=1, store=store)
        assert ck.restore([model], [opt])["step"] == 2
    assert_same(model, opt, snaps[2])
    shards = {p.name: p.stat().st_size for p in (tmp_path / "step-00000002").glob("*.distcp")}
    reads = 1 if memory == "plenty" else 2  # checked and loaded from the same bytes, or checked then streamed
    assert {k.split("/")[1]: n for k, n in store.read.items() if k.endswith(".distcp")} == {
        name: reads * size for name, size in shards.items()
    }
    assert ("do not fit in half the available host memory" in caplog.text) == (memory == "short")


def test_block_reader_serves_verified_bytes_like_a_file():
    """The restore path: the blocks a rank downloaded and checked, read by DCP as a seekable file."""
    from kiln.trainer.checkpoint.dcp_store import BlockReader

    data = bytes(range(256)) * 40 + b"tail"
    reader = BlockReader([data[i : i + 1000] for i in range(0, len(data), 1000)], 1000, len(data))
    reader.seek(995)
    assert reader.read(2010) == data[995:3005]
    reader.seek(-4, os.SEEK_END)
    assert reader.read() == b"tail" and reader.read(5) == b""
    reader.seek(0)
    assert reader.read() == data


def test_pipeline_stages_merge_and_load_into_one_model(tmp_path):
    """Two model parts (pipeline stages, each with its own optimizer, keeping the full model's parameter
    names) save one checkpoint that loads into the unsplit model: a pp=2 → pp=1 resume."""
    full, full_opt = make()
    stage0, stage1 = make()[0], make()[0]
    stage0[2] = nn.Identity()  # stage 0 keeps layer 0, stage 1 keeps layer 2
    stage1[0] = nn.Identity()
    opts = [torch.optim.AdamW(s.parameters(), lr=1e-2) for s in (stage0, stage1)]
    for step in (1, 2):  # both layouts train the same way
        train_step(full, full_opt, step)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for o in opts:
            o.zero_grad()
        stage1[2](stage1[1](stage0[0](x))).pow(2).mean().backward()
        for o in opts:
            o.step()
    ck = checkpointer(tmp_path)
    ck.save(2, [stage0, stage1], opts, {"step": 2}, final=True)

    model, opt = make(seed=5)
    assert checkpointer(tmp_path).restore([model], [opt])["step"] == 2
    assert_same(model, opt, snapshot(full, full_opt))
    with pytest.raises(KilnError, match="one optimizer each"):
        ck.save(3, [stage0, stage1], opts[:1], {"step": 3})
    ck.close()


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    run(tmp_path, 2, interval_steps=2)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))  # a different width, same names
    with pytest.raises(KilnError) as err:
        checkpointer(tmp_path).restore([other], [torch.optim.AdamW(other.parameters())])
    assert "step 2" in str(err.value) and "does not fit this model" in str(err.value)
