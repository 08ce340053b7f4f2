"""A mixture of experts trains under `kiln train` (torchrun, 2 gloo ranks, FSDP): the router's per-step metrics
reach metrics.jsonl, and describe the whole global batch, not rank 0's share."""

from __future__ import annotations

import math

import pytest

from tests.support.runs import MICRO_MODEL, torchrun_train, write_spec
from tests.support.specs import MICRO_MOE_MODEL

pytestmark = pytest.mark.distributed

MICRO_MOE = {**MICRO_MODEL, "preset": "tiny-moe", "moe": {"experts": 4, "topK": 2, "ffnDim": 32}}


def test_moe_run_logs_router_balance_and_losses_each_step(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", model=MICRO_MOE, nproc=2, parallelism={"fsdp": True})
    records = [r for r in torchrun_train(spec, tmp_path / "out", nproc=2) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the global batch: 4 sequences of 32 tokens; per layer, top-2: 256 rows over 4 experts (mean 64), an expert
    # takes a token at most once (<= 128)
    for r in records:
        assert math.isfinite(r["loss"])
        assert r["moe_balance"] >= 1.0 and r["moe_load_cv"] >= 0.0
        assert 0 <= r["moe_idlest_tokens"] <= 64 <= r["moe_busiest_tokens"] <= 128
        # Switch's loss is 1 when the router is uniform and balanced, up to `experts` when all goes to one
        assert 0.9 < r["moe_aux_loss"] < 4.0 and r["moe_z_loss"] > 0


LOADS = ("moe_balance", "moe_load_cv", "moe_busiest_tokens", "moe_idlest_tokens")


def _first_step(out, nproc: int, parallelism: dict) -> dict:
    spec = write_spec(out.parent / f"{out.name}.yaml", model=MICRO_MOE_MODEL, nproc=nproc, parallelism=parallelism,
                      training={"steps": 1})
    return next(r for r in torchrun_train(spec, out, nproc=nproc) if "loss" in r)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The first step's record of one rank holding the whole global batch."""
    return _first_step(tmp_path_factory.mktemp("moe-one-rank") / "out", 1, {})


@pytest.mark.parametrize("parallelism", [{"fsdp": True}, {"expert": 2}, {"tensor": 2}],
                         ids=["fsdp2", "ep2", "tp2"])
def test_router_metrics_count_the_whole_global_batch(tmp_path, one_rank, parallelism):
    """At 2 ranks (FSDP 2; EP 2: tokens computed on the other rank's experts; TP 2: both ranks route the same
    tokens, which must count once) the first step's router metrics equal one rank's on the same global batch,
    exactly: they are functions of routed-token counts, and step 1 routes with the same initial weights. Rank 0's
    share alone gives about half the busiest and idlest counts (it did, before the metrics were summed over the
    data-parallel ranks). The unweighted router losses are means over all the step's microbatches
    (floating-point sums in another order: 1e-6)."""
    two = _first_step(tmp_path / "out", 2, parallelism)
    assert (two["world_size"], two["ep"], two["tp"]) == (2, parallelism.get("expert", 1),
                                                          parallelism.get("tensor", 1))
    assert {k: two[k] for k in LOADS} == {k: one_rank[k] for k in LOADS}
    assert one_rank["moe_busiest_tokens"] >= 64  # the whole batch's rows: 256 per layer over 4 experts
    for k in ("moe_aux_loss", "moe_z_loss"):
        assert two[k] == pytest.approx(one_rank[k], rel=1e-6)


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
