"""plan_layout: how a world of processes splits into pp x dp_replicate x dp_shard x tp, and the batch math."""

from __future__ import annotations

import pytest
from kiln.api import ModelDims, resolve_model
from kiln.api.presets import Arch
from kiln.api.spec import TrainingSpecSpec
from kiln.errors import KilnError
from kiln.trainer.observe.metrics import flops_per_token
from kiln.trainer.model.transformer import count_params
from kiln.trainer.parallel.parallelize import plan_layout, stage_layers


def spec(world: int = 1, **kw) -> TrainingSpecSpec:
    return TrainingSpecSpec.model_validate({"model": {"preset": "tiny"}, "resources": {"processesPerNode": world}, **kw})


def plan(world, **kw):
    s = spec(world, **kw)
    return plan_layout(s, resolve_model(s.model), world)


def test_data_parallel_is_what_tensor_and_pipeline_leave():
    lay = plan(8, parallelism={"tensor": 2, "pipeline": 2}, training={"globalBatchSize": 8, "microBatchSize": 1})
    assert (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, lay.dp) == (2, 1, 2, 2, 2)
    assert lay.grad_accum == 4 and lay.pp_microbatches == 4


def test_hsdp_and_plain_replication():
    lay = plan(8, parallelism={"replicate": 2}, training={"globalBatchSize": 16})
    assert (lay.dp_replicate, lay.dp_shard) == (2, 4)
    lay = plan(4, parallelism={"fsdp": False}, training={"globalBatchSize": 8})
    assert (lay.dp_replicate, lay.dp_shard) == (4, 1)


def test_accumulation_reaches_the_global_batch():
    lay = plan(2, training={"globalBatchSize": 16, "microBatchSize": 2})
    assert lay.grad_accum * lay.micro_batch * lay.dp == 16


# `kiln validate` refuses these specs up front for the world the spec names; plan_layout checks the world that
# actually started (an elastic restart with fewer processes, `kiln train` under a hand-written torchrun), with
# the same rules (kiln.api.layout) and the same messages.
@pytest.mark.parametrize(
    "world,change,message",
    [
        (3, {"parallelism": {"tensor": 2}}, r"spec.parallelism: .* must divide the world size .*world 3\)"),
        (3, {"parallelism": {"tensor": 3}}, r"spec.parallelism.tensor: .* must divide model.heads .*heads=4"),
        (5, {"parallelism": {"pipeline": 5}}, r"spec.parallelism.pipeline: .* must not exceed model.layers"),
        (2, {"training": {"global_batch_size": 3}}, r"spec.training.globalBatchSize: .*got globalBatchSize=3"),
        (4, {"parallelism": {"replicate": 3}}, r"spec.parallelism.replicate: .*got replicate=3"),
        (2, {"parallelism": {"pipeline": 2, "pipeline_microbatches": 3}},
         r"spec.parallelism.pipelineMicrobatches: .*got pipelineMicrobatches=3"),
        # Schedule1F1B needs at least one microbatch per stage; it raised a ValueError inside the pods before
        (2, {"parallelism": {"pipeline": 2, "pipeline_microbatches": 1}},
         r"spec.parallelism.pipelineMicrobatches: .*got pipelineMicrobatches=1, pipeline=2"),
    ],
)
def test_impossible_layouts_name_the_field(world, change, message):
    s = spec(1, training={"globalBatchSize": 4, "microBatchSize": 1})
    for section, fields in change.items():
        for name, value in fields.items():
            setattr(getattr(s, section), name, value)
    with pytest.raises(KilnError, match=message):
        plan_layout(s, resolve_model(s.model), world)


def test_default_pipeline_microbatches_always_split_the_rank_batch():
    # 6 sequences per rank, accumulation 2: max(2 x pipeline, 2) = 4 does not divide 6, so the default is 6
    # (the trainer refused this spec before, with the default it chose itself)
    lay = plan(2, parallelism={"pipeline": 2}, training={"globalBatchSize": 6, "microBatchSize": 3})
    assert lay.pp_microbatches == 6
    lay = plan(2, parallelism={"pipeline": 2}, training={"globalBatchSize": 8, "microBatchSize": 1})
    assert lay.pp_microbatches == 8  # accumulation 8 >= 2 x pipeline: one microbatch per accumulation step


def test_tensor_parallel_stays_within_a_node():
    s = spec(2, parallelism={"tensor": 2}, training={"globalBatchSize": 4})
    assert plan_layout(s, resolve_model(s.model), 4, processes_per_node=2).tp == 2
    with pytest.raises(KilnError, match=r"spec.parallelism.tensor: .*processes per node=1"):
        plan_layout(s, resolve_model(s.model), 4, processes_per_node=1)


def test_stages_cover_every_layer_once():
    for layers in (4, 7, 16):
        for pp in range(1, layers + 1):
            got = [i for s in range(pp) for i in stage_layers(layers, pp, s)]
            assert got == list(range(layers))
            assert all(len(stage_layers(layers, pp, s)) >= 1 for s in range(pp))


def test_flops_per_token_formula():
    dims = resolve_model(spec(model={"preset": "llama-1b"}).model)
    n = count_params(dims, embedding=False)
    assert flops_per_token(dims) == 6 * n + 12 * 16 * 2048 * 2048
    # Llama-1B at 2048 tokens: ~9.4 GFLOP/token, attention adds ~10 % on top of 6N.
    assert 8e9 < flops_per_token(dims) < 1.1e10
    # Gemma 2 9B's shape: attention 16 x 256 = 4096 wide (not dim 3584), every other layer sees 4096 keys of 8192
    gemma = ModelDims(dim=3584, layers=42, heads=16, kv_heads=8, vocab_size=256000, seq_len=8192, ffn_dim=14336,
                      arch=Arch(head_dim=256, sliding_window=4096, sliding_layers=tuple(range(0, 42, 2))))
    n = count_params(gemma, embedding=False)
    assert flops_per_token(gemma) == 6 * n + 12 * 4096 * (21 * 8192 + 21 * 4096)
