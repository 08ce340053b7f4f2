"""Guard state across a restart (kiln.trainer.loop.train, 2 gloo ranks, real Checkpointer on file://).

The run is killed (SIGKILL, every rank) right after its step-6 commit and started again in fresh processes.
The loss spike at step 7, the first step after the resume, must be skipped exactly as in the uninterrupted
run, and the spike at step 8 must complete the rollback series begun before the kill (5, 7, 8), with the
skip and rollback counters continuing. A checkpoint saved without guard state (an older kiln) still resumes;
the detector then warms up again and says so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks
from tests.support.runs import read_metrics, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SPIKES = {5: 50.0, 7: 60.0, 8: 70.0}  # the global loss every rank sees at these steps (one-shot)
KILL_AT = 7  # after the step-6 commit, before the step-7 update


def _rank(rank, world, spec_path, out, ckpt_uri, kill_at, legacy):
    from kiln.api.load import load_file
    from kiln.trainer.guards.step import GuardConfig
    from kiln.trainer.guards.hooks import GuardHooks
    from kiln.trainer.loop import StepHooks, train

    os.makedirs(out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(out, f"log{rank}.txt"))
    logging.getLogger("kiln.guards").addHandler(handler)
    pending = dict(SPIKES)

    def inject(ctx):
        if kill_at is not None and ctx.step == kill_at:
            # Every rank is past the step-6 save here: step 7's loss all-reduce needed all of them.
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.step in pending:
            ctx.loss = pending.pop(ctx.step)
        return True

    restarts = []
    hooks = StepHooks(before_update=[inject], on_restart=[restarts.append])
    guards = GuardHooks(GuardConfig(min_history=4, spike_limit=3, spike_window=6), sdc_every=0, health_interval_s=0)
    if legacy:  # how kiln wired the guards before their state was checkpointed
        hooks.before_update.append(guards.before_update)
        hooks.after_update.append(guards.after_update)
    else:
        guards.install(hooks)
    result = train(load_file(spec_path)[0], output_dir=Path(out), hooks=hooks, checkpoint_uri=ckpt_uri)
    return {"start": result.start_step, "final": result.final_step,
            "restarts": [[e.step, e.tokens_seen] for e in restarts]}


def _run(spec, out, ckpt, *, kill_at=None, legacy=False) -> tuple[list[dict], list[dict]]:
    """The run's metrics records and each rank's result ([] when every rank was killed at step kill_at)."""
    results = run_ranks(_rank, 2, out, str(spec), str(out), f"file://{ckpt}", kill_at, legacy, start="spawn",
                        init=False, expect_signal=None if kill_at is None else signal.SIGKILL)
    return read_metrics(out), results


def _actions(records):
    return [(r["step"], r["guard_action"]) for r in records]


def _counters(record):
    return record["guard_skipped_nonfinite"], record["guard_skipped_spike"], record["guard_rollbacks"]


@pytest.fixture
def spec(tmp_path):
    return write_spec(tmp_path / "spec.yaml", training={"steps": 10}, nproc=2,
                      checkpoint={"intervalSteps": 3, "asyncSave": False, "keep": 10})


def test_resumed_run_detects_the_spike_right_after_resume_like_the_uninterrupted_run(tmp_path, spec):
    whole, results = _run(spec, tmp_path / "whole", tmp_path / "ckpt-whole")
    assert [r["restarts"] for r in results] == [[], []]  # a fresh start, and a rollback, are no restart
    assert _actions(whole) == [(1, "ok"), (2, "ok"), (3, "ok"), (4, "ok"), (5, "skip"), (6, "ok"), (7, "skip"),
                               (8, "rollback"), (7, "ok"), (8, "ok"), (9, "ok"), (10, "ok")]

    before, _ = _run(spec, tmp_path / "before", tmp_path / "ckpt", kill_at=KILL_AT)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5, 6]
    saved = json.loads((tmp_path / "ckpt" / "step-00000006" / "trainer.json").read_text())["hooks"]["guards"]
    assert saved["counters"]["skipped_spike"] == 1 and saved["spikes"] == [5] and len(saved["history"]) == 5

    after, results = _run(spec, tmp_path / "after", tmp_path / "ckpt")
    # every rank's restart hook fired once, for the step-6 commit (6 steps × 4 sequences × 32 tokens)
    assert results == [{"start": 6, "final": 10, "restarts": [[6, 6 * 4 * 32]]}] * 2
    assert _actions(after) == _actions(whole)[6:]  # step 7 is a spike at once: no warm-up after the resume
    for got, want in zip(after, whole[6:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["guard_loss_zscore"] == pytest.approx(want["guard_loss_zscore"], rel=1e-6)
        assert _counters(got) == _counters(want)  # the counters continue from the checkpoint
    assert _counters(after[-1]) == (0, 2, 1)
    assert "steps 5..8" in after[1]["guard_reason"] and after[1]["rolled_back_to"] == 6
    final = json.loads((tmp_path / "ckpt" / "step-00000010" / "trainer.json").read_text())["hooks"]["guards"]
    assert final["skipped_data"] == [[5, 8]] and final["counters"]["rollbacks"] == 1
    assert "no guard state" not in (tmp_path / "after" / "log0.txt").read_text()


def test_checkpoint_without_guard_state_still_resumes_and_the_detector_warms_up(tmp_path, spec):
    _run(spec, tmp_path / "before", tmp_path / "ckpt", kill_at=KILL_AT, legacy=True)
    trainer_state = json.loads((tmp_path / "ckpt" / "step-00000006" / "trainer.json").read_text())
    assert "guards" not in trainer_state.get("hooks", {})

    after, results = _run(spec, tmp_path / "after", tmp_path / "ckpt")
    assert results == [{"start": 6, "final": 10, "restarts": [[6, 6 * 4 * 32]]}] * 2
    # A fresh detector has fewer than min_history losses at step 7 and 8: both spikes pass unnoticed.
    assert _actions(after) == [(7, "ok"), (8, "ok"), (9, "ok"), (10, "ok")]
    assert _counters(after[-1]) == (0, 0, 0)
    log = (tmp_path / "after" / "log0.txt").read_text()
    assert "no guard state" in log and "warms up again (no spike verdict before 4 accepted losses)" in log
    assert (tmp_path / "after" / "log1.txt").read_text() == ""  # said once, by rank 0
