"""A mixture of experts trains under `kiln train` (torchrun, 2 gloo ranks, FSDP): the router's per-step metrics
reach metrics.jsonl."""

from __future__ import annotations

import math

import pytest

from tests.support.runs import MICRO_MODEL, torchrun_train, write_spec

pytestmark = pytest.mark.distributed

MICRO_MOE = {**MICRO_MODEL, "preset": "tiny-moe", "moe": {"experts": 4, "topK": 2, "ffnDim": 32}}


def test_moe_run_logs_router_balance_and_losses_each_step(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", model=MICRO_MOE, nproc=2, parallelism={"fsdp": True})
    records = [r for r in torchrun_train(spec, tmp_path / "out", nproc=2) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # this rank's batch share: 2 microbatches of 32 tokens; per layer, top-2: 128 rows over 4 experts (mean 32), an
    # expert takes a token at most once (<= 64)
    for r in records:
        assert math.isfinite(r["loss"])
        assert r["moe_balance"] >= 1.0 and r["moe_load_cv"] >= 0.0
        assert 0 <= r["moe_idlest_tokens"] <= 32 <= r["moe_busiest_tokens"] <= 64
        # Switch's loss is 1 when the router is uniform and balanced, up to `experts` when all goes to one
        assert 0.9 < r["moe_aux_loss"] < 4.0 and r["moe_z_loss"] > 0


@pytest.mark.slow
def test_moe_checkpoint_from_fsdp_resumes_on_one_rank_on_the_same_curve(tmp_path):
    """The stacked experts and their Adam moments, saved as FSDP2 shards on 2 ranks at step 2, load into one plain
    process and continue the uninterrupted single-process curve (1e-4, as test_trainer_resume_across_worlds:
    a mis-loaded expert or a changed routing moves the loss far more)."""
    def train(name, steps, nproc, out):
        spec = write_spec(tmp_path / f"{name}.yaml", model=MICRO_MOE, nproc=nproc,
                          training={"schedule": "constant", "steps": steps}, checkpoint={"intervalSteps": 1})
        return [r for r in torchrun_train(spec, out, nproc=nproc) if "loss" in r]

    reference = [r["loss"] for r in train("ref", 4, 1, tmp_path / "ref")]
    train("first", 2, 2, tmp_path / "out")
    resumed = train("then", 4, 1, tmp_path / "out")
    assert [r["world_size"] for r in resumed] == [2, 2, 1, 1]
    assert [r["loss"] for r in resumed] == pytest.approx(reference, abs=1e-4)
