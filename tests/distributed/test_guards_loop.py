"""The guards inside the real training loop (kiln.trainer.loop.train, 2 gloo ranks, real Checkpointer):
a NaN step is skipped, a spike series rolls the run back to its last commit and training finishes; the
elastic.plan boundary step is committed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.support.ranks import run_ranks
from tests.support.runs import read_metrics, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

POISON = {2: math.nan, 7: 50.0, 8: 60.0, 9: 70.0}


def _rank(rank, world, spec_path, out):
    from kiln.api.load import load_file
    from kiln.trainer.guards.step import GuardConfig
    from kiln.trainer.guards.hooks import GuardHooks
    from kiln.trainer.loop import StepHooks, train

    pending = dict(POISON)  # one-shot: the steps re-run after the rollback are clean

    def inject(ctx):  # stands in for a bad batch / numerics: the global loss every rank sees
        if ctx.step in pending:
            ctx.loss = pending.pop(ctx.step)
        return True

    hooks = StepHooks(before_update=[inject])
    guards = GuardHooks(GuardConfig(min_history=3, spike_limit=3, spike_window=5), sdc_every=3,
                        health_interval_s=3600)  # a probe at the first step; the interval's cadence: test_guards.py
    guards.install(hooks)
    result = train(load_file(spec_path)[0], output_dir=Path(out), hooks=hooks)  # joins the gloo group itself
    return {"final": result.final_step, "n": len(result.losses), "sdc": guards.sdc.metrics()}


def test_nan_skip_and_spike_rollback_in_the_training_loop(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 10}, nproc=2,
                      checkpoint={"intervalSteps": 3, "asyncSave": False, "keep": 10})
    doc = yaml.safe_load(spec.read_text())  # a phase boundary at step 5: the trainer must commit it
    doc["spec"]["elastic"] = {"plan": [{"untilStep": 5, "nodes": 1}, {"nodes": 1}]}
    spec.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"

    results = run_ranks(_rank, 2, out, str(spec), str(out), start="spawn", init=False)
    records = read_metrics(out)
    actions = [(r["step"], r["guard_action"]) for r in records]
    assert actions == [(1, "ok"), (2, "skip"), (3, "ok"), (4, "ok"), (5, "ok"), (6, "ok"), (7, "skip"),
                       (8, "skip"), (9, "rollback"), (7, "ok"), (8, "ok"), (9, "ok"), (10, "ok")]
    rollback = records[8]
    assert rollback["rolled_back_to"] == 6 and "steps 7..9" in rollback["guard_reason"]
    health = [r for r in records if "gpu_health" in r]
    assert [r["step"] for r in health] == [1]  # the first step; the hour has not passed; this machine has no GPU
    # one node (both ranks share it): probed by local rank 0, gathered by rank 0; never "Healthy" unread
    (node,) = health[0]["gpu_health"]
    assert node["state"] == "NotApplicable" and node["gpus"] == [] and health[0]["gpu_count"] == 0
    last = records[-1]
    assert (last["guard_skipped_nonfinite"], last["guard_skipped_spike"], last["guard_rollbacks"]) == (1, 2, 1)
    assert math.isfinite(last["loss"])
    commits = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert commits == ["step-00000003", "step-00000005", "step-00000006", "step-00000009", "step-00000010"]
    for res in results:
        assert res["final"] == 10 and res["n"] == 13
        assert res["sdc"]["sdc_checks"] >= 3 and res["sdc"]["sdc_mismatches"] == 0
