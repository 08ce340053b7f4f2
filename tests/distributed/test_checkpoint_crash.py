"""kill -9 a rank at random points while checkpoints upload (real gloo processes, file:// and the rig's S3):
resume never loads an uncommitted step, every COMMIT covers complete files, and the newest commit is used."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.storage import open_store
from kiln.storage.commit import committed_steps, read_commit, steps_from_listing, verify_files
from kiln.trainer.checkpoint import Checkpointer

pytestmark = [pytest.mark.distributed]

WORLD = 2
WIDTH = 256  # 4 layers of 256x256 (+ SGD momentum): ~2 MiB of state, so each save takes a while


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _fill(model: nn.Module, opt, step: int) -> None:
    """'Train' to a state that names its step: every parameter and momentum buffer equals the step."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
            opt.state[p]["momentum_buffer"] = torch.full_like(p, float(step))


def _worker(rank: int, port: int, uri: str, env: dict) -> None:
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(CheckpointSpec(uri=uri, interval_steps=1, keep=2), default_uri="", rank=rank, world_size=WORLD)
    state = ck.restore([model], [opt])  # a restarted job resumes from the newest commit
    start = state["step"] + 1 if state else 1
    for step in range(start, 100_000):  # until killed
        _fill(model, opt, step)
        ck.save(step, [model], [opt], {"step": step})


def _wait_for_upload_in_flight(store, committed: int, timeout: float) -> None:
    """Until the store lists files of an uncommitted step newer than `committed` (an upload under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen, done = steps_from_listing(store.list("step-"))
        if any(step > committed and step not in done for step in seen):
            return
        time.sleep(0.005)


def _trial(uri: str, env: dict, rng: random.Random) -> dict:
    """Start the job (it resumes), wait for it to commit one step more, kill -9 a random rank at a random time."""
    store = open_store(uri, env=env)
    ctx = multiprocessing.get_context("fork")  # the children reuse the imported torch
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, uri, env), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        before = max(committed_steps(store), default=0)
        deadline = time.monotonic() + 120
        while max(committed_steps(store), default=0) <= before:  # this run commits something first
            assert all(p.is_alive() for p in procs), "a worker died before the first commit"
            assert time.monotonic() < deadline, "no commit within 120s"
            time.sleep(0.05)
        committed_before = max(committed_steps(store))
        # Aim the kill at an upload: wait until a newer step has files on the store but no COMMIT yet (a fixed
        # random delay mostly lands between uploads on an idle machine), then kill after a random moment.
        _wait_for_upload_in_flight(store, committed_before, timeout=20)
        time.sleep(rng.uniform(0.0, 0.02))
        victim = rng.randrange(WORLD)
        os.kill(procs[victim].pid, signal.SIGKILL)
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


def _trials(uri: str, env: dict, n: int, seed: int) -> None:
    rng = random.Random(seed)
    hit_uploads = []
    for _ in range(n):
        info = _trial(uri, env, rng)
        hit_uploads.append(_check_resume(uri, env, info["committed_before"]))
    # saves run back to back, so kills land mid-save: at least one trial must have left a half-written step
    assert any(hit_uploads), hit_uploads


@pytest.mark.slow
def test_kill9_during_upload_file(tmp_path):
    _trials(f"file://{tmp_path}/ckpt/", {}, n=3, seed=1)


@pytest.mark.slow
@pytest.mark.rig
def test_kill9_during_upload_s3(rig):
    env = {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key}
    prefix = f"test-ckpt-crash/{uuid.uuid4().hex}/"
    uri = f"s3://{rig.s3_bucket}/{prefix}"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env, AWS_ENDPOINT_URL=rig.s3_endpoint)
    try:
        _trials(uri, {**env, "AWS_ENDPOINT_URL": rig.s3_endpoint}, n=2, seed=2)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        os.environ.pop("AWS_ENDPOINT_URL", None)
        open_store(uri, endpoint=rig.s3_endpoint, env=env).delete_prefix("")
