"""The training function: `setup` a run, step it to the end, close it (kiln.trainer.run).

    run = setup(spec)            # mesh -> model -> parallelize -> optimizer -> data -> checkpointer -> restore
    while not run.done:
        run.step()               # data -> forward/backward -> clip -> hooks -> optimizer -> log -> checkpoint
    run.finish(); run.close()

Guards and other per-step logic hook in through `StepHooks` (kiln.trainer.hooks) instead of editing the step;
so do a run's events: a restart from a commit, a heal from a live peer, a replica-group membership change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.api import TrainingSpec
from kiln.trainer.hooks import Heal, MembershipChange, Restart, StepContext, StepHooks
from kiln.trainer.run import setup

__all__ = ["Heal", "MembershipChange", "Restart", "StepContext", "StepHooks", "TrainResult", "train"]


@dataclass
class TrainResult:
    start_step: int  # the step restored from a checkpoint (0 for a fresh run)
    final_step: int
    losses: list[float]  # global loss of every step this call ran


def train(spec_doc: TrainingSpec, *, output_dir: Path | None, hooks: StepHooks | None = None,
          checkpoint_uri: str | None = None, checkpointing: bool = True) -> TrainResult:
    """Train (or resume) the run described by `spec_doc`; metrics go to output_dir/metrics.jsonl on rank 0.

    checkpointing=False neither restores nor saves (throughput benchmarks of models too big to save often).
    """
    run = setup(spec_doc, output_dir=output_dir, hooks=hooks, checkpoint_uri=checkpoint_uri,
                checkpointing=checkpointing)
    try:
        while not run.done:
            run.step()
        run.finish()  # the last save committed; every rank leaves together
    finally:
        run.close()
    return TrainResult(run.start_step, run.last_step, run.losses)  # `last_step`, not a count: a rollback re-runs steps
