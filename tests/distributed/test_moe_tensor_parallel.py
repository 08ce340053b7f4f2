"""Tensor parallelism on a mixture of experts changes where the attention runs, not the numbers: one global batch
through the trainer's own step (kiln.trainer.parallel.microbatches.accumulate_step, the loss with both router losses)
on real gloo ranks at TP 2 (world 2) and at TP 2 x EP 2 (world 4: FSDP 2 borrowed by EP 2, each rank holding 2 of
the 4 experts) gives the 1-rank run's loss and full gradient of every parameter.

Tolerance 1e-4 relative, as the EP test's: TP only reorders floating-point sums (the row-parallel projections sum
their heads' partial products in another order, the all-gathers none); a router or expert gradient that was summed
over the TP ranks instead of taken once is off by a factor of 2, a token routed on a sequence slice instead of the
whole microbatch changes the load-balancing loss by far more than 1e-4.

The router and expert weights are replicated over the TP ranks (kiln.trainer.parallel.parallelize._moe_tp_plan):
every TP rank of a data-parallel slice must hold the same gradient for them, bit for bit, or the copies would drift
apart step by step; checked exactly here.

Then the trainer end to end: a run saved at TP 2 resumes on one rank (router and experts are plain there, the
attention unsharded by DCP) and continues the loss curve of an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.layout_grads import layout_grads, random_batch
from tests.support.ranks import run_ranks
from tests.support.runs import train_micro_moe
from tests.support.specs import MICRO_MOE_MODEL

pytestmark = pytest.mark.distributed

SEED, GLOBAL_BATCH, MICRO_BATCH = 5, 8, 1


def _run(out, world: int, name: str, parallelism: dict) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """(the layout's global loss, each rank's full gradients by parameter name)."""
    out.mkdir(exist_ok=True)
    losses = run_ranks(layout_grads, world, out, str(out), random_batch, GLOBAL_BATCH, MICRO_BATCH, SEED,
                       {name: parallelism}, MICRO_MOE_MODEL)
    assert len({r[name] for r in losses}) == 1  # every rank reports the same global loss
    return losses[0][name], [torch.load(out / f"{name}-{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    loss, (grads,) = _run(tmp_path_factory.mktemp("one-rank"), 1, "one", {})
    return loss, grads


@pytest.mark.parametrize("world,parallelism", [(2, {"tensor": 2}), (4, {"tensor": 2, "expert": 2})],
                         ids=["tp2", "tp2xep2"])
def test_tensor_parallel_moe_gives_the_losses_and_gradients_of_one_rank(tmp_path, one_rank, world, parallelism):
    want_loss, want = one_rank
    loss, per_rank = _run(tmp_path / "run", world, "layout", parallelism)
    moe_params = [k for k in want if ".feed_forward." in k]
    assert any(".experts.w1" in k for k in moe_params) and any(".router.gate" in k for k in moe_params)
    for other in per_rank[1:]:  # replicated over TP (router, experts) or made whole (sharded): the same everywhere
        for pname, g in other.items():
            torch.testing.assert_close(g, per_rank[0][pname], rtol=0, atol=0, msg=lambda m: f"{pname}: {m}")
    got = per_rank[0]
    assert got.keys() == want.keys()
    for pname, g in want.items():
        assert g.abs().sum() > 0, pname  # every parameter takes part, so equal gradients mean something
        torch.testing.assert_close(got[pname], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{pname}: {m}")
    assert loss == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.slow  # three torchrun runs
def test_checkpoint_saved_at_tp2_resumes_on_one_rank(tmp_path):
    (tmp_path / "ref").mkdir()
    ref = train_micro_moe(tmp_path / "ref", tmp_path / "ref" / "out", steps=4, nproc=1, parallelism={})
    uninterrupted = [r["loss"] for r in ref]
    assert uninterrupted[-1] < uninterrupted[0]  # it trains
    out = tmp_path / "out"
    saved = train_micro_moe(tmp_path, out, steps=2, nproc=2, parallelism={"tensor": 2})
    assert [r["tp"] for r in saved] == [2, 2]
    resumed = train_micro_moe(tmp_path, out, steps=4, nproc=1, parallelism={})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [(r["world_size"], r["tp"]) for r in resumed] == [(2, 2), (2, 2), (1, 1), (1, 1)]
    assert [r["loss"] for r in resumed] == pytest.approx(uninterrupted, abs=1e-4)
