"""AdamW, the learning-rate schedules (pure functions of the step) and gradient clipping for sharded grads."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from kiln.api.spec import TrainingConfig


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warm-up to cfg.lr, then the schedule.

    cosine: half a cosine from lr down to lr*min_lr_ratio at the last step; linear: a straight line to the
    same floor; constant: lr; wsd (warmup-stable-decay): lr until the last decay_fraction of the steps,
    then linear to the floor. A pure function, so resuming needs only the step.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_steps = max(1, math.ceil(cfg.decay_fraction * cfg.steps))
        decay_start = max(cfg.warmup_steps, cfg.steps - decay_steps)
        if step <= decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
        return peak - (peak - floor) * progress
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model_parts: list[nn.Module], cfg: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over every part; no weight decay on 1-D parameters (norm gains). The fused kernel on CUDA and CPU: on
    CPU, foreach runs one kernel per parameter and per elementwise op (~10 passes over every parameter), the
    fused one a single pass (bench_vs_torchtitan)."""
    decay, no_decay = [], []
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
    # no empty group (LoRA trains only matrices): DCP's flattened optimizer state cannot load one. One group per
    # mesh (by_mesh), and the flattened state keys each parameter by name: a checkpoint loads at any EP degree.
    groups = [{"params": ps, "weight_decay": wd} for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
              for ps in by_mesh(params)]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=lr_at(1, cfg), betas=(0.9, 0.95), eps=1e-8, fused=fused,
                             foreach=None if fused else True)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by the DeviceMesh of the DTensors among them (plain tensors together), in first-seen
    order. One group without expert parallelism; with it, the experts live on another mesh than the other weights
    (kiln.trainer.parallel.expert) and DTensor refuses a foreach or fused op whose inputs span two meshes."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm over every shard and pipeline stage; returns the norm before clipping.

    Gradients may be DTensors (FSDP shards, TP shards): their norm is reduced over the mesh by DTensor,
    then `full_tensor()` makes it a plain number. Pipeline stages hold disjoint parameters, so the squared
    norms are summed over the pipeline group. max_norm <= 0 only measures.

    With `optimizer`, the step that follows may do the scaling instead (`folds_clip`): the fused AdamW divides
    each gradient by its `grad_scale` as it reads it (the hook torch's GradScaler uses), which saves a pass
    over every gradient; the gradients themselves then stay unclipped until that step.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    # DTensor reduces a norm over one mesh: each mesh's (by_mesh) is made whole on its own, then they combine.
    norms = []
    for group in by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm() if norms else torch.tensor(0.0)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt()
    fold = optimizer is not None and folds_clip(optimizer, grads)
    if fold:  # set every step, so a step without clipping leaves no scale from an earlier one
        optimizer.grad_scale = None
    if max_norm > 0:
        if fold:  # 1 / torch's clip coefficient (max_norm / (norm + 1e-6), at most 1)
            optimizer.grad_scale = 1.0 / (max_norm / (total + 1e-6)).clamp(max=1.0)
        else:
            for group in by_mesh(params):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def folds_clip(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> bool:
    """Whether `optimizer` can apply the clip itself: the fused AdamW over plain tensors (a DTensor optimizer
    step would meet a plain scale tensor among DTensors)."""
    return bool(optimizer.defaults.get("fused")) and all(type(g) is torch.Tensor for g in grads)
