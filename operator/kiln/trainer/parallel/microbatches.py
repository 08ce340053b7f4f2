"""One pass of the model over a rank's batch, microbatch by microbatch, for the training step (kiln.trainer.run)
and the held-out loss (kiln.trainer.evaluate: the run's `val_loss` and `kiln eval`).

`pipeline_step` is the one 1F1B pass both use. Without a pipeline the training step keeps its own loop
(`run.accumulate_step`: a backward after each microbatch frees its activations, and the loss may be summed over
the global batch's tokens); `microbatch_losses` is its forward-only counterpart, the same slicing into
microbatches with the model taking its own mean loss.
"""

from __future__ import annotations

import torch
from torch import nn


def microbatch_losses(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      micro_batch: int) -> list[torch.Tensor]:
    """The model's mean loss on each `micro_batch` rows of the batch, in order (the model takes its own loss)."""
    return [model(inputs[i:i + micro_batch], targets[i:i + micro_batch]) for i in range(0, len(inputs), micro_batch)]


def pipeline_step(schedule, inputs, targets, is_first: bool, is_last: bool, *,
                  train: bool = True, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """One 1F1B pass over this rank's batch: forward and backward, or forward only (`train` False: the schedule's
    eval, no gradients). The last stage returns the mean of its microbatch losses, the other stages None.
    `doc_ids` (packed rows): every stage's attention needs them; the schedule splits keyword inputs into the same
    microbatches as the rows and hands them to every stage."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if is_first else ()
    kwargs = {"target": targets, "losses": losses} if is_last else {}
    if doc_ids is not None:
        kwargs["doc_ids"] = doc_ids
    (schedule.step if train else schedule.eval)(*args, **kwargs)
    return torch.stack([l.detach() for l in losses]).mean() if is_last else None
