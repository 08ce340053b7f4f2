"""training.precision bf16 through `kiln train` on CPU ranks (torchrun, gloo): FSDP2 casts the fp32 master
weights to bf16 for compute and reduces gradients in fp32, with data parallel and with tensor parallel 2.

What is observed, not assumed (tests.distributed.observed_train): every nn.Linear's output is bf16 (the matmuls
ran in bf16; a policy that silently left compute in fp32 fails here), FSDP2 all-gathers bf16 parameters and
reduce-scatters fp32 gradients, and the optimizer steps fp32 tensors (the master weights).

Tolerance on the loss, per step, against the fp32 run with the same seed and data (FSDP2 dp 2 for both layouts:
in fp32 every layout gives the same curve within 1e-4, tests/distributed/test_trainer_layouts.py): 1 % of the
loss. bf16 keeps
8 significant bits, so each rounded value is off by at most 2^-9 (0.2 %) relative; the loss averages
log-probabilities over 4 x 32 tokens, each from logits summed over 64-128 products, so the roundings mostly cancel
(measured here: at most 0.04 %). 1 % is some 25x that, and a tenth of what the model learns over these steps (the
fp32 loss falls by more than 10 %), so a run that stopped learning or diverged still fails.
"""

from __future__ import annotations

import pytest

from tests.support.runs import observed, torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
TOL = 0.01
TRAINING = {"steps": STEPS, "lr": 3e-3}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> list[float]:
    d = tmp_path_factory.mktemp("fp32")
    records = torchrun_train(write_spec(d / "spec.yaml", nproc=2, training={**TRAINING, "precision": "fp32"},
                                        parallelism={"fsdp": True}), d / "out", 2)
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and losses[-1] < 0.9 * losses[0]  # it learns more than 10 %
    return losses


@pytest.mark.parametrize("parallelism", [{"fsdp": True}, {"tensor": 2}], ids=["fsdp-dp2", "tp2"])
def test_bf16_computes_in_bf16_keeps_fp32_master_weights_and_tracks_fp32(tmp_path, fp32, parallelism):
    spec = write_spec(tmp_path / "spec.yaml", nproc=2, training={**TRAINING, "precision": "bf16"},
                      parallelism=parallelism)
    losses = [r["loss"] for r in torchrun_train(spec, tmp_path / "out", 2, observe=tmp_path / "observed")]
    for rank in observed(tmp_path / "observed", 2):
        assert rank["activations"]["Linear"] == ["torch.bfloat16"], rank["activations"]
        assert rank["optimizer_params"] == ["torch.float32"]
        reduces = {k for k in rank["collectives"] if k.startswith("reduce_scatter")}
        if "fsdp" in parallelism:  # dp 2: parameters gathered in bf16, gradients reduced in fp32
            assert {k for k in rank["collectives"] if k.startswith("all_gather")} == {"all_gather_single torch.bfloat16"}
            assert reduces == {"reduce_scatter_single torch.float32"}
        else:  # one data-parallel rank: FSDP2 only casts; nothing to reduce across ranks
            assert reduces == set()
    assert losses == pytest.approx(fp32, rel=TOL)
    assert losses != fp32  # bf16 rounding really changed the arithmetic
