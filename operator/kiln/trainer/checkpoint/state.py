"""Model and optimizer state dicts of several model parts (pipeline stages), FQN-keyed (kiln.trainer.checkpoint.checkpointer)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim import Optimizer

from kiln.errors import KilnError

# FQN keys: mergeable over pipeline stages. Frozen parameters (a LoRA run's base) are left out: a commit holds
# what trains; strict=False lets them be absent on load, where every key asked for is one collect_state took
# from the model itself (and DCP loads all of those or fails).
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _pairs(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[tuple[nn.Module, list[Optimizer]]]:
    if len(model_parts) == 1:
        return [(model_parts[0], list(optimizers))]
    if len(optimizers) == len(model_parts):
        return [(m, [o]) for m, o in zip(model_parts, optimizers)]
    raise KilnError(
        f"checkpoint: {len(model_parts)} model parts need one optimizer each (got {len(optimizers)} optimizers)"
    )


def collect_state(model_parts, optimizers) -> tuple[dict[str, Any], list[tuple[set[str], set[str]]]]:
    """{"model": {...}, "optim": {...}} merged over parts, and each part's key sets (to split on load)."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for model, opts in _pairs(model_parts, optimizers):
        msd, osd = get_state_dict(model, opts, options=STATE_OPTIONS)
        model_sd.update(msd)
        optim_sd.update(osd)
        keys.append((set(msd), set(osd)))
    return {"model": model_sd, "optim": optim_sd}, keys
