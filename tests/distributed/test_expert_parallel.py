"""Expert parallelism changes where experts run, not the numbers: one global batch through the trainer's own step
(kiln.trainer.parallel.microbatches.accumulate_step, loss with the router losses) on real gloo ranks at EP 1 and at
EP 2 (world 2: each rank holds 2 of the 4 experts), and at EP 2 x FSDP 2 (world 4: experts sharded over the EP pair
and FSDP over the other pair), gives the same loss and the same full gradient of every parameter (tolerance 1e-4
relative: the layouts differ only in the order of floating-point sums; a gradient summed over the wrong ranks or
divided by the wrong count is off by a factor of 2, a lost or duplicated token by far more than 1e-4).

Then the trainer end to end: a run saved at EP 2 resumes at EP 1 (experts resharded by DCP) and continues the loss
curve of an uninterrupted EP 2 run.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.layout_grads import layout_grads, random_batch
from tests.support.ranks import run_ranks
from tests.support.runs import torchrun_train, write_spec
from tests.support.specs import MICRO_MOE_MODEL as MOE_MODEL

pytestmark = pytest.mark.distributed

SEED = 5


def _grads(tmp_path, name: str, world: int) -> dict[str, torch.Tensor]:
    got = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(world)]
    for other in got[1:]:  # every rank made the full gradients whole: the same on each
        for pname, g in other.items():
            torch.testing.assert_close(g, got[0][pname], rtol=0, atol=0)
    return got[0]


@pytest.mark.parametrize("world,layouts", [
    (2, {"ep1": {}, "ep2": {"expert": 2}}),
    (4, {"ep1": {}, "ep2xfsdp2": {"expert": 2}}),
], ids=["ep2", "ep2xfsdp2"])
def test_expert_parallel_gives_the_losses_and_gradients_of_ep1(tmp_path, world, layouts):
    losses = run_ranks(layout_grads, world, tmp_path, str(tmp_path), random_batch, 8, 1, SEED, layouts, MOE_MODEL)
    ep1, (name, _) = _grads(tmp_path, "ep1", world), list(layouts.items())[1]
    got = _grads(tmp_path, name, world)
    assert got.keys() == ep1.keys() and any(".experts.w1" in k for k in got)
    for pname, g in ep1.items():
        assert g.abs().sum() > 0, pname  # every parameter takes part, so equal gradients mean something
        torch.testing.assert_close(got[pname], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name} {pname}: {m}")
    for r in losses:
        assert r[name] == pytest.approx(r["ep1"], rel=1e-5)


TRAINING = {"schedule": "constant", "globalBatchSize": 4}
PARALLEL = {"expert": 2}


def _train(tmp_path, out, *, steps: int, nproc: int, parallelism: dict) -> list[dict]:
    spec = write_spec(tmp_path / f"spec-{steps}-{nproc}.yaml", training={**TRAINING, "steps": steps},
                      parallelism=parallelism, model=MOE_MODEL, checkpoint={"intervalSteps": 1}, nproc=nproc)
    return torchrun_train(spec, out, nproc)


@pytest.mark.slow  # three torchrun runs
def test_checkpoint_saved_at_ep2_resumes_at_ep1(tmp_path):
    (tmp_path / "ref").mkdir()
    uninterrupted = [r["loss"] for r in _train(tmp_path / "ref", tmp_path / "ref" / "out", steps=4, nproc=2,
                                               parallelism=PARALLEL)]
    assert uninterrupted[-1] < uninterrupted[0]  # it trains
    out = tmp_path / "out"
    saved = _train(tmp_path, out, steps=2, nproc=2, parallelism=PARALLEL)
    assert [r["ep"] for r in saved] == [2, 2]
    resumed = _train(tmp_path, out, steps=4, nproc=1, parallelism={})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [(r["world_size"], r["ep"]) for r in resumed] == [(2, 2), (2, 2), (1, 1), (1, 1)]
    assert [r["loss"] for r in resumed] == pytest.approx(uninterrupted, abs=1e-4)
