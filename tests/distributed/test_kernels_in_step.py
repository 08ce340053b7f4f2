"""The Triton kernels inside a real training step on CPU ranks, under Triton's interpreter: kiln's model,
parallelized by kiln with FSDP2 over 2 ranks and with tensor parallel 2 (sequence parallel: DTensor inputs),
one forward and backward with the fused kernels and one with the reference, same weights and batch
(tests/kernels/in_step.py).

Tolerances are the fp32 ones of the kernel cases (tests/kernels/cases.py): the kernels compute in fp32 like the
reference, only the order of summation differs, so the loss agrees to 1e-5 relative and every gradient to 1e-4
of its own largest element (the fused cross-entropy sums over chunks in another order).

Routing, observed per call: with the fused kernels on, every op whose arguments are plain tensors on the kernel
device runs Triton, no DTensor reaches a Triton kernel, and under tensor parallel the sequence-parallel
rms_norm's DTensors do reach the switch and take the reference, while swiglu and rope run Triton on each rank's
local shard.
"""

from __future__ import annotations

import pytest

from tests.kernels.in_step import step_case
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {"fsdp-dp2": {"fsdp": True}, "tp2": {"tensor": 2}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # from the spawned ranks' birth, as Triton requires; not in this process
        ranks = run_ranks(step_case, 2, tmp_path_factory.mktemp("in-step"), LAYOUTS, start="spawn")
    return ranks[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_kernels_give_the_reference_loss_and_gradients_in_a_step(results, layout):
    r = results[layout]
    assert r["loss"]["fused"] == pytest.approx(r["loss"]["reference"], rel=1e-5)
    assert r["grad_error"] <= 1e-4, r["grad_error"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plain_tensors_take_triton_and_dtensors_the_reference(results, layout):
    fused, reference = results[layout]["kernels"]["fused"], results[layout]["kernels"]["reference"]
    assert not any(k.startswith("triton") for k in reference)  # parallelism.kernels: reference means it
    assert not any(k.startswith("triton") and "DTensor" in k for k in fused), fused
    # everything else that reached the reference in fused mode came as DTensors
    assert all("DTensor" in k for k in fused if k.startswith("reference")), fused
    ran = {k.split()[1] for k in fused if k.startswith("triton")}
    if layout == "tp2":
        assert ran == {"swiglu", "apply_rope"}  # the loss is taken from the logits under TP
        assert "reference rms_norm DTensor" in fused
    else:
        assert ran == {"rms_norm", "swiglu", "apply_rope", "fused_linear_cross_entropy"}
