"""Where code outside the training loop plugs into a run (kiln.trainer.run): `StepHooks`.

Per step: `before_update` (may skip the optimizer step or ask for a rollback) and `after_update`. Per run: the
checkpoint store (`record_incidents`, once, before the restore) and three events, each raised from one place in
kiln.trainer.run:

- `restarted`: this process resumed from a committed checkpoint (a restart of the job, or of this replica group
  when no live peer was ahead of it); not raised for a fresh start, nor for a guard's rollback;
- `healed`: a replica group received a live peer's weights, optimizer and trainer state (no checkpoint read),
  at its start or when it fell behind;
- `membership_changed`: the torchft quorum changed (a replica group left or joined), after the first quorum.

Each event method calls the callables registered in its list, in order; a subclass may override it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class StepContext:
    """What a hook sees after backward and clipping, before the optimizer step."""

    step: int
    loss: float  # global mean loss of this step (identical on every rank)
    grad_norm: float  # global gradient norm before clipping (identical on every rank)
    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    mesh: object
    record: dict  # the metrics record of this step; hooks may add fields
    rollback: bool = False  # a hook sets it: restore the last commit, keep the data cursor (kiln.trainer.guards)
    # the fraction of the global batch this step averaged: live replica groups / groups (1.0 outside that mode)
    batch_share: float = 1.0


@dataclass(frozen=True)
class Restart:
    """This process resumed from the commit of `step` (`tokens_seen` and the data cursor with it)."""

    step: int
    tokens_seen: int


@dataclass(frozen=True)
class Heal:
    """This replica group took a live peer's state at `step`; `at_start`: when it joined, else mid-run."""

    step: int
    tokens_seen: int
    at_start: bool


@dataclass(frozen=True)
class MembershipChange:
    """A new torchft quorum: `participants` of `groups` replica groups live; this group is `replica_rank`."""

    step: int  # the last step this group committed before the new quorum
    quorum_id: int
    participants: int
    groups: int
    replica_rank: int


@dataclass
class StepHooks:
    """`before_update` hooks return False to skip this optimizer step (the gradients are dropped, the data is
    still consumed); `after_update` hooks run after the step (e.g. SDC checks).

    `state` names objects whose `state_dict()` (JSON-serialisable) goes into every checkpoint's trainer state
    under "hooks"/<name>; on resume each gets `load_state_dict(saved)`, or `load_state_dict(None)` when the
    checkpoint has nothing under its name (saved before the hook kept state).

    `incident_stores` get the run's checkpoint store (records that must outlive the process, e.g. the guards'
    SDC mismatches); `on_restart`, `on_heal` and `on_membership_change` get the events named in the module
    docstring."""

    before_update: list[Callable[[StepContext], bool]] = field(default_factory=list)
    after_update: list[Callable[[StepContext], None]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    incident_stores: list[Callable[[Any], None]] = field(default_factory=list)
    on_restart: list[Callable[[Restart], None]] = field(default_factory=list)
    on_heal: list[Callable[[Heal], None]] = field(default_factory=list)
    on_membership_change: list[Callable[[MembershipChange], None]] = field(default_factory=list)
    # the pre-flight check's matmul (kiln.trainer.observe.preflight), None for torch.matmul: a test slows one
    # rank's probe by giving it more work
    preflight_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def record_incidents(self, store) -> None:
        """The run's checkpoint store (a kiln ObjectStore), once, before the restore; not with checkpointing off."""
        for keep in self.incident_stores:
            keep(store)

    def restarted(self, event: Restart) -> None:
        for hook in self.on_restart:
            hook(event)

    def healed(self, event: Heal) -> None:
        for hook in self.on_heal:
            hook(event)

    def membership_changed(self, event: MembershipChange) -> None:
        for hook in self.on_membership_change:
            hook(event)
