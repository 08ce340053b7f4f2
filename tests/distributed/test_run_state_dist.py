"""The run's state registry (kiln.trainer.state) in real runs, solo (2 gloo ranks, FSDP2) and as a replica group
(torchft, a lighthouse in this process): a part the trainer does not know, given to `setup`, is saved with the
commits, rolled back by a rollback and restored by a fresh run, and a fresh run restored from the last commit
holds the same state (the registry's digest of every part, rank by rank) as the run that saved it."""

from __future__ import annotations

import pytest

from tests.distributed.ft_helpers import lighthouse_server
from tests.state_parts import Counter
from tests.support.ranks import run_ranks
from tests.support.runs import write_spec

pytestmark = pytest.mark.distributed

STEPS, INTERVAL, ROLL_BACK_AT = 8, 4, 6


def _train(rank: int, world: int, spec_path: str, out: str) -> dict:
    """Train to the end with a rollback at ROLL_BACK_AT; the registry's digest as each save wrote it."""
    from pathlib import Path

    from kiln.api.load import load_file
    from kiln.trainer.run import setup

    counter = Counter()
    run = setup(load_file(spec_path)[0], output_dir=Path(out), state_parts={"counter": counter})
    saved: dict[int, str] = {}
    save = run.checkpointer.save

    def digest_then_save(step, *args, **kwargs):  # the state as this save writes it
        saved[step] = run.state.digests()
        return save(step, *args, **kwargs)

    rolled: list[int] = []

    def count(ctx) -> None:
        counter.n += 1
        if ctx.step == ROLL_BACK_AT and not rolled:  # once: to the commit of step INTERVAL
            ctx.rollback = True
            rolled.append(ctx.step)

    run.checkpointer.save = digest_then_save
    run.hooks.after_update.append(count)
    try:
        while not run.done:
            run.step()
        run.finish()
    finally:
        run.close()
    return {"counter": counter.n, "step": run.last_step, "saved": saved}


def _restore(rank: int, world: int, spec_path: str, out: str) -> dict:
    """A fresh run (new processes) of the same spec: restored from the last commit."""
    from pathlib import Path

    from kiln.api.load import load_file
    from kiln.trainer.run import setup

    counter = Counter()
    run = setup(load_file(spec_path)[0], output_dir=Path(out), state_parts={"counter": counter})
    try:
        return {"step": run.last_step, "counter": counter.n, "digests": run.state.digests()}
    finally:
        run.close()


@pytest.mark.parametrize("mode", ["solo", "replica_group"])
def test_every_part_is_saved_rolled_back_and_restored(tmp_path, monkeypatch, mode):
    ckpt = {"uri": f"file://{tmp_path / 'ckpt'}", "intervalSteps": INTERVAL}
    # without the pre-flight check: a restoring process's own probe adds to the goodput part it just restored
    off = {"preflight": {"enabled": False}}
    if mode == "solo":
        spec = write_spec(tmp_path / "spec.yaml", training={"steps": STEPS}, checkpoint=ckpt, nproc=2,
                          parallelism={"fsdp": True}, resources={"processesPerNode": 2, **off})
        world = 2
    else:  # one replica group of one rank: its own torchft quorum, restored from the commit (no live peer)
        spec = write_spec(tmp_path / "spec.yaml", training={"steps": STEPS}, checkpoint=ckpt, nproc=1,
                          resources={"processesPerNode": 1, **off},
                          elastic={"faultTolerance": {"mode": "replicaGroups", "groups": 1}})
        world = 1
        server = lighthouse_server()
        monkeypatch.setenv("KILN_FT_LIGHTHOUSE", server.address())
        monkeypatch.setenv("KILN_FT_GROUP", "0")
    try:
        trained = run_ranks(_train, world, tmp_path / "train", str(spec), str(tmp_path / "out"), init=False)
        restored = run_ranks(_restore, world, tmp_path / "restore", str(spec), str(tmp_path / "again"), init=False)
    finally:
        if mode != "solo":
            server.shutdown()
    writer = trained[0]["saved"][str(STEPS)]  # rank 0 writes trainer.json: every rank resumes its JSON parts
    for t, r in zip(trained, restored, strict=True):
        # steps 1..6, back to the commit of step 4 (the counter with it: 4), then 5..8 again
        assert t["step"] == t["counter"] == STEPS, t
        assert sorted(map(int, t["saved"])) == [INTERVAL, STEPS], t
        assert r["step"] == r["counter"] == STEPS, r
        mine = t["saved"][str(STEPS)]
        want = {name: mine[name] if name in ("model", "optim") else writer[name] for name in mine}
        assert r["digests"] == want  # every part, by name: this rank's shards, rank 0's JSON
