"""How a step's loss is normalised: the mean next-token loss over the tokens that carry loss in the whole global batch.

Plain data: every target carries loss and every microbatch holds the same number of tokens, so the mean of the
microbatch means (each divided by gradient accumulation, then averaged over data-parallel ranks by the gradient
reduction) is the global mean, and the step runs exactly as it always has (`denominator` None).

Chat data (data.format chat) and packed rows (data.packing): targets outside the assistant's turns, across a
document boundary or in padding are IGNORE, and how many tokens carry loss
differs between microbatches and ranks; a mean of per-microbatch means would weigh a microbatch's few assistant
tokens like another's many. Instead each microbatch contributes (sum of its token losses) / N, N the number of
loss-carrying targets in the whole global batch (`global_count`, one all-reduce per step), times the
data-parallel size, because the gradient reduction over data-parallel ranks takes their mean. The loss kernels
(kiln.trainer.model.kernels, model.cross_entropy) return the mean over a microbatch's non-IGNORE targets, so that sum is
the mean times the microbatch's count. IGNORE targets add nothing to the loss or its gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE = -100  # the target of a position that carries no loss (torch's ignore_index default)


def global_count(targets: torch.Tensor, layout) -> torch.Tensor:
    """Loss-carrying targets in the global batch, from this rank's slice: summed over all ranks, of which each
    data-parallel slice is held by world / dp of them (tensor and pipeline ranks see the same rows)."""
    count = (targets != IGNORE).sum().to(torch.int64).reshape(1)
    if layout.world > 1:
        dist.all_reduce(count)
        count = count // (layout.world // layout.dp)
    return count.clamp(min=1).to(torch.float32).reshape(())


def microbatch_loss(mean: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor | None, layout,
                    parts: int) -> torch.Tensor:
    """The loss to backpropagate for one of `parts` microbatches of this rank's batch, from the kernel's mean
    over its loss-carrying targets; see the module docstring. `parts` is what the caller divides gradients by."""
    if denominator is None:
        return mean / parts
    return mean * ((targets != IGNORE).sum() * layout.dp) / denominator


class PipelineLoss:
    """The last pipeline stage's loss function: the schedule calls it per microbatch and divides gradients by
    the number of microbatches itself (scale_grads). `denominator` is set before each step (None: plain data)."""

    def __init__(self, loss_fn, layout):
        self.loss_fn, self.layout = loss_fn, layout
        self.denominator: torch.Tensor | None = None

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        # a mixture of experts' last stage returns (logits, the router loss of the whole model), which the loss
        # takes as the unsplit model's does (Transformer.stage_forward)
        logits, router = output if isinstance(output, tuple) else (output, None)
        mean = self.loss_fn(logits, targets)
        if router is not None:
            mean = mean + router.reshape(())
        if self.denominator is None:
            return mean
        # x microbatches: undoes the schedule's division, which the plain mean relies on
        return microbatch_loss(mean, targets, self.denominator, self.layout, 1) * self.layout.pp_microbatches


def global_loss(local: torch.Tensor | None, layout, device: torch.device) -> float:
    """The mean loss over data-parallel replicas, the same on every rank: `local` from the one rank per replica
    that reports it (the last pipeline stage, tensor rank 0), None from the others."""
    value = local.detach().float().reshape(()) if local is not None else torch.zeros((), device=device)
    if layout.world > 1:
        value = value.clone()
        dist.all_reduce(value)
    return float(value) / layout.dp
