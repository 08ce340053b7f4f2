"""Pipeline parallelism on a mixture of experts splits its layers over stages, not the numbers: one global batch
through the trainer's own 1F1B step (kiln.trainer.parallel.microbatches.pipeline_step, the loss with both router
losses) on real gloo ranks at PP 2 (world 2), PP 2 x EP 2 (world 4: each stage's FSDP pair borrowed by EP 2, each
rank holding 2 of the 4 experts) and PP 2 x TP 2 (world 4) gives the 1-rank run's loss and full gradient of every
parameter; a stage holds only its own layers, so the stages' gradients together are compared.

The load-balancing loss is not a sum of per-stage terms (it multiplies the expert loads of every MoE layer by
their mean probabilities over every layer), so the stages pass the router totals along with the hidden states
(Transformer.stage_forward) and the last adds the loss; its gradient goes back to the routers of the first stage
through the schedule. A pipeline that added a loss per stage, or dropped the first stage's router terms, moves the
router gradients by far more than the tolerance (1e-4 relative, as the EP and TP tests': the layouts reorder
floating-point sums only).

Then the trainer end to end: a run at PP 2 reports the same router metrics as one rank (every layer's loads, the
pipeline's stages summed), and its checkpoint resumes on one rank and continues the uninterrupted loss curve.
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


def _run(out, world: int, name: str, parallelism: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """(the layout's global loss, the full gradient of every parameter, from the stage that holds it)."""
    out.mkdir(exist_ok=True)
    losses = run_ranks(layout_grads, world, out, str(out), random_batch, GLOBAL_BATCH, MICRO_BATCH, SEED,
                       {name: parallelism}, MICRO_MOE_MODEL)
    assert len({r[name] for r in losses}) == 1  # every rank reports the same global loss
    grads: dict[str, torch.Tensor] = {}
    for rank in range(world):
        for pname, g in torch.load(out / f"{name}-{rank}.pt").items():
            if pname in grads:  # another rank of the same stage (EP, FSDP or TP): made whole, the same tensor
                torch.testing.assert_close(g, grads[pname], rtol=0, atol=0, msg=lambda m: f"{pname}: {m}")
            grads[pname] = g
    return losses[0][name], grads


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one-rank"), 1, "one", {})


@pytest.mark.parametrize("world,parallelism", [(2, {"pipeline": 2}), (4, {"pipeline": 2, "expert": 2}),
                                               (4, {"pipeline": 2, "tensor": 2})],
                         ids=["pp2", "pp2xep2", "pp2xtp2"])
def test_pipelined_moe_gives_the_losses_and_gradients_of_one_rank(tmp_path, one_rank, world, parallelism):
    want_loss, want = one_rank
    loss, got = _run(tmp_path / "run", world, "layout", parallelism)
    assert got.keys() == want.keys()
    routers = [k for k in want if ".router.gate" in k]
    assert len(routers) == 2 and any(".experts.w1" in k for k in want)  # a MoE layer on each stage
    for pname, g in want.items():
        assert g.abs().sum() > 0, pname  # every parameter takes part, so equal gradients mean something
        torch.testing.assert_close(got[pname], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{pname}: {m}")
    assert loss == pytest.approx(want_loss, rel=1e-5)


ROUTER_COUNTS = ("moe_busiest_tokens", "moe_idlest_tokens")


@pytest.mark.slow  # three torchrun runs
def test_pipelined_moe_reports_the_router_of_one_rank_and_resumes_on_one_rank(tmp_path):
    (tmp_path / "ref").mkdir()
    uninterrupted = train_micro_moe(tmp_path / "ref", tmp_path / "ref" / "out", steps=4, nproc=1, parallelism={})
    assert uninterrupted[-1]["loss"] < uninterrupted[0]["loss"]  # it trains
    out = tmp_path / "out"
    saved = train_micro_moe(tmp_path, out, steps=2, nproc=2, parallelism={"pipeline": 2})
    assert [r["pp"] for r in saved] == [2, 2]
    for got, want in zip(saved, uninterrupted):  # the same tokens routed the same way: the same counts
        assert {k: got[k] for k in ROUTER_COUNTS} == {k: want[k] for k in ROUTER_COUNTS}
        for key in ("moe_balance", "moe_load_cv", "moe_aux_loss", "moe_z_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), key
    resumed = train_micro_moe(tmp_path, out, steps=4, nproc=1, parallelism={})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [(r["world_size"], r["pp"]) for r in resumed] == [(2, 2), (2, 2), (1, 1), (1, 1)]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in uninterrupted], abs=1e-4)
