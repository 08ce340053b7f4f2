"""spec.training and spec.parallelism: the optimisation and how the world of processes is split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.base import ApiModel
from kiln.api.spec.limits import INT32_MAX, JSON_INT_MAX, JSON_INT_MIN


class TrainingConfig(ApiModel):
    """The optimisation: steps, batch, learning-rate schedule, precision."""

    steps: int = Field(1000, ge=1, le=JSON_INT_MAX, description="Optimizer steps to train for.")
    global_batch_size: int = Field(8, ge=1, le=JSON_INT_MAX, description="Sequences per optimizer step, summed over all data-parallel ranks.")
    micro_batch_size: int = Field(1, ge=1, le=JSON_INT_MAX, description="Sequences per forward/backward on one rank; the rest is gradient accumulation.")
    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr (cosine, linear, wsd).")
    warmup_steps: int = Field(0, ge=0, le=JSON_INT_MAX, description="Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Learning-rate schedule after warm-up: cosine | linear | constant | wsd (warmup-stable-decay)."
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="For wsd: fraction of steps spent in the final decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value; 0 disables clipping.")
    precision: Literal["bf16", "fp32"] = Field(
        "bf16", description="bf16: bf16 compute with fp32 master weights and reductions; fp32: everything in fp32."
    )
    seed: int = Field(0, ge=JSON_INT_MIN, le=JSON_INT_MAX, description="Seed for initialisation and data order; the same seed gives the same run.")
    log_every: int = Field(1, ge=1, le=JSON_INT_MAX, description="Log metrics every this many steps.")


class ParallelismSpec(ApiModel):
    """How the world of processes is split: data parallel size is derived as world / (tensor x pipeline)."""

    tensor: int = Field(1, ge=1, le=INT32_MAX, description="Tensor-parallel degree; divides processes per node and the head counts.")
    pipeline: int = Field(1, ge=1, le=INT32_MAX, description="Pipeline-parallel stages; must not exceed layers.")
    pipeline_microbatches: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Microbatches per pipeline step: at least pipeline, dividing each data-parallel "
        "rank's sequences (default: the fewest >= max(2 x pipeline, gradient accumulation) that divide them)."
    )
    fsdp: bool = Field(True, description="Shard parameters, gradients and optimizer state over data parallel (FSDP2).")
    replicate: int = Field(
        1, ge=1, le=INT32_MAX, description="HSDP: replicate over this many groups, shard within each (usually = nodes)."
    )
    expert: int = Field(
        1, ge=1, le=INT32_MAX, description="Expert-parallel degree of a mixture-of-experts model: each expert lives on "
        "one of this many ranks, tokens travel to it by all-to-all. Borrowed from FSDP's shard ranks (divides world / "
        "(tensor x pipeline x replicate)) and divides model.moe.experts.",
    )
    compile: bool = Field(True, description="torch.compile each transformer block.")
    activation_checkpoint: Literal["none", "selective", "full"] = Field(
        "none", description="Recompute activations in backward to save memory: none | selective | full."
    )
    kernels: Literal["fused", "reference"] = Field(
        "fused", description="fused: Triton kernels on GPU (torch.compile elsewhere); reference: plain PyTorch ops."
    )
    gradient_compression: Literal["none", "bf16", "powersgd"] = Field(
        "none", description="Compress gradients on the replicated data-parallel dimension: none | bf16 | powersgd."
    )
