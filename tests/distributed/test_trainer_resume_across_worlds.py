"""A checkpoint of `kiln train` resumes at another world size with the same loss curve (real torchrun + gloo).

At one data-parallel rank in fp32 the model has plain parameters (no FSDP, `parallel.uses_fsdp`); at two it
has FSDP2's DTensor shards. A commit saved by either must load into the other and continue exactly as the
uninterrupted single-process run (tolerance as in test_trainer_layouts: 1e-4 absolute; a mis-loaded weight or
optimizer state moves the loss by far more).
"""

from __future__ import annotations

import pytest

from tests.support.runs import torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-4
# constant learning rate: a run of 2 steps resumed to 4 sees the same rates as a run of 4
TRAINING = {"schedule": "constant"}


def _train(tmp_path, out, *, steps: int, nproc: int) -> list[dict]:
    spec = write_spec(tmp_path / f"spec-{steps}-{nproc}.yaml", training={**TRAINING, "steps": steps},
                      checkpoint={"intervalSteps": 1}, nproc=nproc)
    return torchrun_train(spec, out, nproc)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    d = tmp_path_factory.mktemp("ref")
    losses = [r["loss"] for r in _train(d, d / "out", steps=4, nproc=1)]
    assert losses[-1] < losses[0]  # it trains
    return losses


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)], ids=["plain-to-fsdp", "fsdp-to-plain"])
def test_resume_at_another_world_size_continues_the_curve(tmp_path, uninterrupted, first, then):
    out = tmp_path / "out"
    saved = _train(tmp_path, out, steps=2, nproc=first)
    assert [r["world_size"] for r in saved] == [first, first]
    resumed = _train(tmp_path, out, steps=4, nproc=then)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 1-2 from the first run, 3-4 resumed
    assert [r["world_size"] for r in resumed] == [first, first, then, then]
    assert [r["loss"] for r in resumed] == pytest.approx(uninterrupted, abs=TOL)
