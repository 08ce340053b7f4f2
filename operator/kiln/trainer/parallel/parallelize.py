"""Hybrid parallelism on one DeviceMesh, applied to the plain model (TorchTitan style).

Mesh dimensions, outermost first: pp x dp_replicate x dp_shard x tp = world size.
- tp: tensor parallel with DTensor plans; norms run sequence-parallel (activations sharded on seq).
- dp_shard: FSDP2 `fully_shard` (params, grads, optimizer state sharded); with dp_replicate > 1 it is
  HSDP (replicated across groups, sharded within). `fsdp: false` puts the whole dp on dp_replicate:
  plain replication with all-reduced gradients.
- pp: `torch.distributed.pipelining`, one stage per rank, 1F1B schedule over microbatches.
- ep (parallelism.expert > 1): borrowed from dp_shard, which splits into efsdp x ep (flattened back into
  dp_shard and dp); a mixture of experts' experts live on the ep ranks (kiln.trainer.parallel.expert).
Each `apply_*` does one concern; `plan_layout` is the pure rule deciding the sizes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import nn

from kiln.api import ModelDims
from kiln.api.layout import Layout, dims_shape, plan as plan_world
from kiln.api.spec import TrainingSpecSpec
from kiln.errors import KilnError
from kiln.trainer.model.moe import MoE


def plan_layout(spec: TrainingSpecSpec, dims: ModelDims, world: int, processes_per_node: int | None = None) -> Layout:
    """The parallel sizes for `world` processes, `processes_per_node` of them per node (torchrun's
    LOCAL_WORLD_SIZE; default: all on one node). The arithmetic is kiln.api.layout's, the same that
    `kiln validate` and the operator's elastic controller use; a KilnError names each field that does not fit."""
    ppn = processes_per_node or world
    if world % ppn:
        raise KilnError(f"{world} processes do not fill nodes of {ppn} each (torchrun's --nproc-per-node)")
    return plan_world(spec, world // ppn, ppn, dims_shape(dims))


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout.ep > 1:  # EP borrowed from FSDP's shard ranks: dp_shard = efsdp x ep (kiln.trainer.parallel.expert)
        mesh = init_device_mesh(
            device_type,
            (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.ep, layout.tp),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"),
        )
        mesh["efsdp", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "efsdp", "ep"]._flatten("dp")
        # mesh["dp_shard"] is now a flattened dim, and torch warns (once per rank) that slicing one from the root
        # "will be deprecated in PT 2.11"; this torch still supports it and the rest of the trainer slices by
        # name. When torch drops it: keep the meshes _flatten returns instead, as TorchTitan does.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    else:
        mesh = init_device_mesh(
            device_type,
            (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )
        # Flattened views (TorchTitan does the same): mesh["dp"] is all of data parallel; with TP, DTensor finds
        # "dp_shard_tp" and reduces the gradient norm over FSDP x TP in one collective instead of two.
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if layout.tp > 1:
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return mesh


def dp_coordinates(mesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process: which slice of the global batch it reads."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


# --- pipeline split -----------------------------------------------------------------------------------


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Contiguous, balanced block indices owned by pipeline stage `stage`."""
    return range(stage * n_layers // pp, (stage + 1) * n_layers // pp)


def split_for_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """Keep only this stage's blocks (names unchanged); the first stage keeps the embedding, the last the head.
    The stage runs `stage_forward` (what a pipeline passes between stages: kiln.trainer.model.transformer)."""
    keep = {str(i) for i in stage_layers(len(model.layers), pp, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None
    model.forward = model.stage_forward
    return model


def check_stages_train(targets: list[str], stages: list[set[str]], n_layers: int) -> None:
    """KilnError naming spec.model.adapter.targets when a LoRA run's pipeline stage would train nothing (AdamW
    refuses an empty optimizer). `stages`: each stage's targets (kiln.trainer.model.lora.offered_targets of its
    layers), known to every rank, so that every rank refuses alike rather than one leaving the others waiting."""
    for stage, offered in enumerate(stages):
        if not offered & set(targets):
            layers = stage_layers(n_layers, len(stages), stage)
            raise KilnError(f"spec.model.adapter.targets: {', '.join(targets)} name no module of pipeline stage "
                            f"{stage} of {len(stages)} (spec.parallelism.pipeline; its layers {layers.start} to "
                            f"{layers.stop - 1} have {', '.join(sorted(offered))}); every stage must train an "
                            f"adapter: add a target its layers have")


def build_pipeline_schedule(stage_module: nn.Module, mesh, layout: Layout, device: torch.device, loss_fn):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    pp_mesh = mesh["pp"]
    stage = PipelineStage(stage_module, pp_mesh.get_local_rank(), layout.pp, device, group=pp_mesh.get_group())
    if stage_module.dims.moe is not None and hasattr(stage, "register_forward_context"):  # the torch here has it
        # the first step runs one extra forward per stage to learn the shapes: its routing is not the step's
        load = stage_module.router_load
        stage.register_forward_context(
            lambda info: load.unchanged() if info.is_metadata_inference else contextlib.nullcontext())
    # scale_grads: gradients are averaged over microbatches, as with plain gradient accumulation.
    return Schedule1F1B(stage, n_microbatches=layout.pp_microbatches, loss_fn=loss_fn, scale_grads=True)


# --- tensor parallel ----------------------------------------------------------------------------------


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron-style plan: q/k/v and w1/w3 column-wise (their biases sharded with them), wo and w2 row-wise;
    norms sequence-parallel. Qwen3/Gemma 3's per-head q/k norms see this rank's heads: their weight is
    replicated and the heads dimension (2 of batch, seq, heads, head_dim) is the sharded one, so their
    gradient is summed over the TP ranks as a sequence-parallel norm's is."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
        # Full logits on every TP rank: the loss stays a plain tensor op.
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        extra = {}
        if block.attention.q_norm is not None:
            heads = SequenceParallel(sequence_dim=2, use_local_output=True)
            extra.update({"attention.q_norm": heads, "attention.k_norm": heads})
        if block.attention_post_norm is not None:  # Gemma: on the row-parallel outputs, sequence-sharded
            extra.update({"attention_post_norm": SequenceParallel(use_local_output=True),
                          "ffn_post_norm": SequenceParallel(use_local_output=True)})
        parallelize_module(block, tp_mesh, {
            **extra,
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **(_moe_tp_plan() if isinstance(block.feed_forward, MoE) else {
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }),
        })


def _moe_tp_plan() -> dict:
    """A mixture of experts under TP: every TP rank runs the whole MoE (router, experts or its EP share of them,
    shared expert) on the TP group's gathered tokens, as plain tensors, and keeps its own sequence slice of the
    result. The one all-gather is the dense MLP's; the slice back needs no communication. Router and expert
    weights stay plain (or EP/FSDP) tensors replicated over tp: the same inputs and the same output gradient
    give them the same gradient on every TP rank (tests/distributed/test_moe_tensor_parallel.py checks it
    bit for bit), and the router losses see every token of the microbatch, as at TP 1. docs/trainer.md says
    why not sequence-sharded routing."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {"feed_forward": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))}


# --- activation checkpointing and compile ---------------------------------------------------------------

# Selective: keep the matmul and attention outputs, recompute the cheap pointwise ops (norms, SwiGLU, RoPE).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """none | full (recompute each block) | selective (recompute only pointwise ops).

    The block's forward is wrapped in place, so parameter names do not change (checkpoints stay portable).
    """
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    for block in model.layers.values():
        kwargs = {"use_reentrant": False}
        if mode == "selective":
            kwargs["context_fn"] = _selective_context
        block.forward = functools.partial(checkpoint, block.forward, **kwargs)


def compiles_whole(layout: Layout, precision: str) -> bool:
    """Compile the whole model (embedding, blocks, head and loss: one graph forward, one backward) where
    nothing wraps its blocks: no FSDP (its per-block hooks would split the graph), no TP or PP. Inductor then
    fuses across block boundaries and a step makes one compiled call, not one per block and the head (the
    same losses; faster on the debug model on CPU, docs/trainer.md)."""
    return not uses_fsdp(layout, precision) and layout.tp == 1 and layout.pp == 1


def apply_compile(model: nn.Module, *, whole: bool = False) -> None:
    """torch.compile the whole model in place (`whole`), or each block in place (nn.Module.compile keeps
    parameter names) and the head (final norm, output projection, loss) when the model computes its own loss
    with the reference kernels: fused there, cross-entropy and its backward are one pass over the logits
    instead of several. The Triton kernels are fused already, and under TP or PP the loss is taken outside."""
    from kiln.trainer.model import kernels

    if whole:
        model.compile()
        return
    for block in model.layers.values():
        block.compile()
    if model.norm is not None and model.fused_loss and kernels.reference_runs():
        model.head = torch.compile(model.head)


# --- data parallel ----------------------------------------------------------------------------------------


def apply_fsdp(model: nn.Module, mesh, layout: Layout, precision: str, compression: str = "none") -> None:
    """FSDP2 per block and at the root; bf16 compute with fp32 master weights and fp32 gradient reduction
    (bf16 reduction with gradientCompression: bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kiln.trainer.parallel.compression import fsdp_reduce_dtype

    dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    reduce_dtype = fsdp_reduce_dtype(compression, precision)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if precision == "bf16" \
        else MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    # Pipeline schedules run several microbatches forward before backward: keep params gathered meanwhile.
    # One shard per parameter (dp_shard 1): resharding frees no memory and costs a second gather in backward.
    reshard = layout.pp == 1 and layout.dp_shard > 1
    if layout.ep > 1:
        from kiln.trainer.parallel.expert import shard_experts

        shard_experts(model, mesh, layout, mp, reshard)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root keeps its inputs' dtypes: each block casts its own, and a mixture of experts' pipeline stage
    # takes the router totals (float64 counts, exact; Transformer.stage_forward), which bf16 would round.
    root_mp = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=root_mp, reshard_after_forward=reshard)


def uses_fsdp(layout: Layout, precision: str) -> bool:
    """FSDP2 only where it has work to do: more than one data-parallel rank (it shards or replicates over
    them), or bf16 compute (its mixed precision casts the fp32 master weights, in every layout alike). At one
    data-parallel rank in fp32 it would only copy every parameter and gradient through its buffers each step
    (~12 % of a CPU step, bench_vs_torchtitan); the parameters stay plain tensors then (DTensors of the tp
    mesh under TP), as in TorchTitan. Checkpoints stay portable: DCP saves plain tensors and DTensors alike
    and loads either into the other at any world size."""
    return layout.dp > 1 or precision == "bf16"


def parallelize(model: nn.Module, mesh, layout: Layout, spec: TrainingSpecSpec) -> nn.Module:
    """Split for the pipeline, then TP, EP, LoRA adapters, activation checkpointing, compile, FSDP: TorchTitan's order."""
    from kiln.trainer.parallel.compression import apply_replicate, check_supported

    compression = spec.parallelism.gradient_compression
    check_supported(compression, fsdp=spec.parallelism.fsdp, tensor=layout.tp)
    stages = None  # a LoRA pipeline's targets stage by stage: a target is the whole model's, a stage may lack it
    if layout.pp > 1:
        if spec.model.adapter is not None:
            from kiln.trainer.model.lora import offered_targets

            stages = [offered_targets(model, stage_layers(model.dims.layers, layout.pp, s)) for s in range(layout.pp)]
        split_for_stage(model, layout.pp, mesh["pp"].get_local_rank())
    if layout.tp > 1 or layout.pp > 1:
        model.fused_loss = False  # the loss is computed from (replicated) logits, see Transformer
    if layout.tp > 1:
        apply_tp(model, mesh["tp"])
    if layout.ep > 1:
        from kiln.trainer.parallel.expert import apply_ep

        apply_ep(model, mesh["ep"])
    if spec.model.adapter is not None:  # after TP (an adapter follows its base's plan), before FSDP (shards it)
        from kiln.trainer.model.lora import apply_lora

        apply_lora(model, spec.model.adapter, torch.bfloat16 if spec.training.precision == "bf16" else torch.float32,
                   set().union(*stages) if stages else None)
        if stages:
            check_stages_train(spec.model.adapter.targets, stages, model.dims.layers)
    apply_activation_checkpointing(model, spec.parallelism.activation_checkpoint)
    if spec.parallelism.compile:
        apply_compile(model, whole=compiles_whole(layout, spec.training.precision))
    if compression == "powersgd":  # plain replication (fsdp: false) with torch's PowerSGD comm hook
        apply_replicate(model, mesh["dp_replicate"], compression)
    elif uses_fsdp(layout, spec.training.precision):
        apply_fsdp(model, mesh, layout, spec.training.precision, compression)
    return model
