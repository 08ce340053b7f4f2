"""One pass of the model over a rank's batch, microbatch by microbatch: the one implementation that the training
step (kiln.trainer.run) and the held-out loss (kiln.trainer.evaluate: the run's `val_loss` and `kiln eval`) share,
so that what evaluation scores is what training computes.
"""

from __future__ import annotations

import torch
from torch import nn


def microbatch_losses(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      micro_batch: int) -> list[torch.Tensor]:
    """The model's mean loss on each `micro_batch` rows of the batch, in order (the model takes its own loss)."""
    return [model(inputs[i:i + micro_batch], targets[i:i + micro_batch]) for i in range(0, len(inputs), micro_batch)]


def pipeline_step(schedule, inputs, targets, is_first: bool, is_last: bool, *,
                  train: bool = True) -> torch.Tensor | None:
    """One 1F1B pass over this rank's batch: forward and backward, or forward only (`train` False: the schedule's
    eval, no gradients). The last stage returns the mean of its microbatch losses, the other stages None."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if is_first else ()
    kwargs = {"target": targets, "losses": losses} if is_last else {}
    (schedule.step if train else schedule.eval)(*args, **kwargs)
    return torch.stack([l.detach() for l in losses]).mean() if is_last else None
