"""One pass of the model over a rank's batch, microbatch by microbatch, for the training step (kiln.trainer.run)
and the held-out loss (kiln.trainer.evaluate: the run's `val_loss` and `kiln eval`).

`pipeline_step` is the one 1F1B pass both use. Without a pipeline the training step keeps its own loop
(`accumulate_step`: a backward after each microbatch frees its activations, and the loss may be summed over
the global batch's tokens); `microbatch_losses` is its forward-only counterpart, the same slicing into
microbatches with the model taking its own mean loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.trainer.model.loss import microbatch_loss

if TYPE_CHECKING:
    from kiln.trainer.parallel.parallelize import Layout


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


def accumulate_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, layout: Layout,
                    denominator: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Forward/backward over grad_accum microbatches; gradients average over them (and over dp, by FSDP), or
    with a `denominator` sum over the global batch's loss-carrying tokens (kiln.trainer.model.loss). `doc_ids`:
    packed rows' documents (data.packing), sliced with their microbatch."""
    total = torch.zeros((), device=inputs.device)
    m = layout.micro_batch
    for i in range(layout.grad_accum):
        # Reduce gradients across data parallel only once, after the last microbatch.
        if hasattr(model, "set_requires_gradient_sync"):  # no data-parallel wrapper at dp 1: nothing to sync
            model.set_requires_gradient_sync(i == layout.grad_accum - 1)
        rows = slice(i * m, (i + 1) * m)
        batch = targets[rows]
        docs = {} if doc_ids is None else {"doc_ids": doc_ids[rows]}
        loss = microbatch_loss(model(inputs[rows], batch, **docs), batch, denominator, layout, layout.grad_accum)
        loss.backward()
        total += loss.detach()
    return total
