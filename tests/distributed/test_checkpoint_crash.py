"""kill -9 a rank at random points while checkpoints upload (real gloo processes, file:// and the rig's S3):
resume never loads an uncommitted step, every COMMIT covers complete files, and the newest commit is used."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid

import pytest
import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.storage import open_store
from kiln.storage.commit import committed_steps, read_commit, steps_from_listing, verify_files
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from tests.support.ranks import fsdp_per_layer, start_ranks, wait_until

pytestmark = [pytest.mark.distributed]

WORLD = 2
WIDTH = 256  # 4 layers of 256x256 (+ SGD momentum): ~2 MiB of state, so each save takes a while


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _fill(model: nn.Module, opt, step: int) -> None:
    """'Train' to a state that names its step: every parameter and momentum buffer equals the step."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
            opt.state[p]["momentum_buffer"] = torch.full_like(p, float(step))


def _worker(rank: int, world: int, uri: str, env: dict) -> None:
    os.environ.update(env)
    model = fsdp_per_layer(_model(), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(CheckpointSpec(uri=uri, interval_steps=1, keep=2), default_uri="", rank=rank, world_size=world)
    state = ck.restore([model], [opt])  # a restarted job resumes from the newest commit
    start = state["step"] + 1 if state else 1
    for step in range(start, 100_000):  # until killed
        _fill(model, opt, step)
        ck.save(step, [model], [opt], {"step": step})


def _upload_in_flight(store) -> bool:
    """The store lists files of a step newer than every COMMIT: a save under way (or cut off)."""
    seen, committed = steps_from_listing(store.list("step-"))
    return any(step > max(committed, default=0) for step in seen)


def _signal(procs, sig: int) -> None:
    for p in procs:
        os.kill(p.pid, sig)


def _trial(uri: str, env: dict, rng: random.Random, out) -> dict:
    """Start the job (it resumes), wait for it to commit one step more, kill -9 a random rank during an upload."""
    store = open_store(uri, env=env)
    before = max(committed_steps(store), default=0)
    procs = start_ranks(_worker, WORLD, out, uri, env)
    alive = lambda: all(p.is_alive() for p in procs)  # noqa: E731 - a worker that dies early fails the wait
    try:
        wait_until("this run's first commit", lambda: max(committed_steps(store), default=0) > before, alive=alive)
        committed_before = max(committed_steps(store))
        # Kill inside an upload, checked rather than hoped for: once files of an uncommitted step show, let the
        # ranks run on a random moment (a random point of the upload), freeze them (SIGSTOP) and look again.
        # Still uncommitted: the kill lands inside that upload. Committed meanwhile: thaw, wait for the next.
        def frozen_in_upload() -> bool:
            wait_until("an upload in flight", lambda: _upload_in_flight(store), alive=alive)
            time.sleep(rng.uniform(0.0, 0.02))
            _signal(procs, signal.SIGSTOP)
            if _upload_in_flight(store):
                return True
            _signal(procs, signal.SIGCONT)
            return False

        wait_until("the ranks frozen inside an upload", frozen_in_upload, alive=alive)
        victim = rng.randrange(WORLD)
        os.kill(procs[victim].pid, signal.SIGKILL)
        _signal([p for i, p in enumerate(procs) if i != victim], signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.3))  # the survivor runs on a moment, as under torchrun's teardown
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    return {"victim": victim, "committed_before": committed_before}


def _check_resume(uri: str, env: dict, committed_before: int) -> bool:
    """Resume checks; returns whether the kill left a half-written step behind (it hit an upload)."""
    store = open_store(uri, env=env)
    committed = committed_steps(store)
    seen, _ = steps_from_listing(store.list("step-"))
    # every COMMIT on the store covers complete, matching files: none was written early
    for step in committed:
        commit = read_commit(store, step)
        assert not verify_files(store, step, commit, sorted(commit.files)), f"step {step} committed but damaged"
    newest = committed[0]
    assert newest >= committed_before  # nothing committed was lost
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = Checkpointer(CheckpointSpec(uri=uri), default_uri="", rank=0, world_size=1).restore([model], [opt])
    assert state["step"] == newest
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, float(newest)))
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, float(newest)))
    return any(s > newest for s in seen)


def _trials(uri: str, env: dict, n: int, seed: int, out) -> None:
    rng = random.Random(seed)
    hit_uploads = []
    for i in range(n):
        info = _trial(uri, env, rng, out / f"trial-{i}")
        hit_uploads.append(_check_resume(uri, env, info["committed_before"]))
    # every kill struck inside an upload; unless the survivor finished that commit (it may, when the victim's
    # part was already done), a half-written step stays behind
    assert any(hit_uploads), hit_uploads


@pytest.mark.slow
def test_kill9_during_upload_file(tmp_path):
    _trials(f"file://{tmp_path}/ckpt/", {}, n=3, seed=1, out=tmp_path)


@pytest.mark.slow
@pytest.mark.rig
def test_kill9_during_upload_s3(rig, tmp_path):
    env = {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}
    prefix = f"test-ckpt-crash/{uuid.uuid4().hex}/"
    uri = f"s3://{rig.s3_bucket}/{prefix}"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env, AWS_ENDPOINT_URL=rig.s3_endpoint)
    try:
        _trials(uri, {**env, "AWS_ENDPOINT_URL": rig.s3_endpoint}, n=2, seed=2, out=tmp_path)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        os.environ.pop("AWS_ENDPOINT_URL", None)
        open_store(uri, endpoint=rig.s3_endpoint, env=env).delete_prefix("")
