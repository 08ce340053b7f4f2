"""The same model, seed and data give the same loss curve in every parallel layout (real torchrun + gloo).

Tolerance: 1e-4 absolute on a loss of ~5.5 in fp32. The layouts differ only in the order of floating-point
reductions (FSDP reduce-scatter, TP partial sums, pipeline microbatches), which moves the loss by ~1e-6;
a wrong layout (a missing gradient reduction, a duplicated or dropped shard, a wrong data slice) moves it
by far more than 1e-3 within four steps.
"""

from __future__ import annotations

import pytest

from tests.support.runs import torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-4


@pytest.fixture(scope="module")
def reference_records(tmp_path_factory) -> list[dict]:
    """World 1, microbatch 1 x 4 accumulation steps."""
    d = tmp_path_factory.mktemp("ref")
    return torchrun_train(write_spec(d / "spec.yaml"), d / "out", nproc=1)


@pytest.fixture(scope="module")
def reference(reference_records) -> list[float]:
    losses = [r["loss"] for r in reference_records]
    assert len(losses) == 4
    assert losses[-1] < losses[0]  # it trains: otherwise equal curves would prove little
    return losses


@pytest.mark.parametrize(
    "nproc,parallelism",
    [
        (2, {"fsdp": True}),  # dp=2 (FSDP2)
        (2, {"fsdp": False}),  # dp=2 replicated (all-reduce)
        (2, {"tensor": 2}),  # tp=2 with sequence parallel
        (2, {"pipeline": 2}),  # pp=2, 1F1B over 4 microbatches
        (4, {"tensor": 2}),  # dp=2 x tp=2
    ],
    ids=["dp2-fsdp", "dp2-replicate", "tp2", "pp2", "dp2xtp2"],
)


def test_layout_matches_single_process(tmp_path, reference, reference_records, nproc, parallelism):
    spec = write_spec(tmp_path / "spec.yaml", parallelism=parallelism, nproc=nproc)
    records = torchrun_train(spec, tmp_path / "out", nproc)
    assert [r["loss"] for r in records] == pytest.approx(reference, abs=TOL)
    # The held-out loss at the end: same weights, same validation batches, in any layout.
    assert records[-1]["val_loss"] == pytest.approx(reference_records[-1]["val_loss"], abs=TOL)
    # Every logged step carries the numbers a user and the operator read.
    tp, pp = parallelism.get("tensor", 1), parallelism.get("pipeline", 1)
    for step, r in enumerate(records, start=1):
        assert r["step"] == step
        assert (r["world_size"], r["tp"], r["pp"], r["dp_replicate"] * r["dp_shard"]) == (nproc, tp, pp, nproc // (tp * pp))
        assert r["global_batch_tokens"] == 4 * 32
        assert r["tokens_per_second"] > 0 and r["mfu"] is None  # no known peak on CPU: no MFU, not a guess
        assert r["step_s"] == pytest.approx(r["data_s"] + r["fwd_bwd_s"] + r["optim_s"])
    assert any((tmp_path / "out" / "tensorboard").iterdir()), "TensorBoard event file written"


def test_gradient_accumulation_4x1_equals_1x4(tmp_path, reference):
    # reference: microBatchSize 1, accumulated 4 times; here one microbatch of 4 sequences.
    spec = write_spec(tmp_path / "spec.yaml", training={"microBatchSize": 4})
    losses = [r["loss"] for r in torchrun_train(spec, tmp_path / "out", nproc=1)]
    assert losses == pytest.approx(reference, abs=TOL)


@pytest.mark.parametrize("nproc", [1, 2], ids=["whole-model", "per-block-fsdp"])
def test_compiled_blocks_match_eager(tmp_path, reference, nproc):
    """parallelism.compile changes speed, not the numbers (beyond rounding): at one process the whole model is
    one graph (parallel.compiles_whole); under FSDP (dp 2) each block is compiled on its own."""
    spec = write_spec(tmp_path / "spec.yaml", parallelism={"compile": True}, nproc=nproc)
    losses = [r["loss"] for r in torchrun_train(spec, tmp_path / "out", nproc=nproc)]
    assert losses == pytest.approx(reference, abs=TOL)
