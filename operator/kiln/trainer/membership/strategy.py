"""Who takes part in a step, as one strategy the run calls at fixed points (kiln.trainer.run): `Solo` (the job
is the whole data-parallel world) or `ReplicaGroups` (elastic.faultTolerance replicaGroups: this job is one
group of several, on torchft; kiln.trainer.membership.replica_groups). The run has no branch on the mode: it
is decided once, by kiln.api.layout.replica_groups_on, in `open_membership`.

The points, in a run's order: `waits_for_peers` (set-up: do before `join` what can be, the live groups wait
from then on), `join` (before the restore: a peer's state was loaded), `restored`, then per step
`begin_step` (a heal when this group fell behind), `next_batch`, `reduce_gradients`, `reduce_loss`, `commit`
(the step's vote and the data cursor), `step_tokens`, `batch_share`, `metrics`/`final_metrics`,
`writes_checkpoints`; `watch_hangs` from the first step on (the loop's hang watch), `close` at the end.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from kiln.api.layout import replica_groups_on
from kiln.trainer.hooks import MembershipChange
from kiln.trainer.membership.hang_watch import HangWatch
from kiln.trainer.observe import hang_report
from kiln.trainer.state import RunState


class Membership(Protocol):
    waits_for_peers: bool  # others wait for this process from its join on (warm up and set weights before it)
    rows_per_step: int  # global batch rows this job reads per step (split over its data-parallel ranks)
    writes_checkpoints: bool
    batch_share: float  # the fraction of the global batch a step averages (the guards judge its loss by it)

    def join(self) -> bool: ...
    def restored(self, step: int, from_checkpoint: bool) -> None: ...
    def begin_step(self, step: int) -> bool: ...
    def next_batch(self, loader, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]: ...
    def reduce_gradients(self, model_parts) -> None: ...
    def reduce_loss(self, loss: float) -> float: ...
    def commit(self, loader) -> bool: ...
    def step_tokens(self, seq_len: int) -> int: ...
    def metrics(self) -> dict: ...
    def final_metrics(self) -> dict: ...
    def watch_hangs(self, on_hang: Callable[[str], None]) -> HangWatch: ...
    def close(self) -> None: ...


class Solo:
    """The job is the whole data-parallel world: nobody to join, wait for, vote with or heal from."""

    waits_for_peers = False
    writes_checkpoints = True
    batch_share = 1.0

    def __init__(self, global_batch_size: int):
        self.rows_per_step = global_batch_size

    def join(self) -> bool:
        return False

    def restored(self, step: int, from_checkpoint: bool) -> None:
        pass

    def begin_step(self, step: int) -> bool:
        return False

    def next_batch(self, loader, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
        return loader.next_batch(self.rows_per_step)  # the loader knows this rank's rows; the cursor moves

    def reduce_gradients(self, model_parts) -> None:
        pass  # FSDP/DDP reduced them over the job's data-parallel ranks already

    def reduce_loss(self, loss: float) -> float:
        return loss

    def commit(self, loader) -> bool:
        return True

    def step_tokens(self, seq_len: int) -> int:
        return self.rows_per_step * seq_len

    def metrics(self) -> dict:
        return {}

    def final_metrics(self) -> dict:
        return {}

    def watch_hangs(self, on_hang: Callable[[str], None]) -> HangWatch:
        """The loop's hang watch, started: a verdict goes to `on_hang` (the run's stack report); the operator
        restarts the run."""
        watch = HangWatch(floor=hang_report.floor_s())
        watch.start(on_hang)
        return watch

    def close(self) -> None:
        pass


def open_membership(spec, *, rank: int, world: int, device: torch.device, state: RunState,
                    on_membership_change: Callable[[MembershipChange], None]) -> Membership:
    """The spec's strategy (torchft is imported only for replica groups)."""
    if not replica_groups_on(spec):
        return Solo(spec.training.global_batch_size)
    from kiln.trainer.membership.replica_groups import ReplicaGroups

    return ReplicaGroups(spec, rank=rank, world=world, device=device, state=state,
                         on_membership_change=on_membership_change)
