"""The run's state, as one registry of `Stateful` parts (the shape of TorchTitan's `CheckpointManager.states`):
what a checkpoint saves and restores, a guard's rollback restores and a healing replica group receives
(kiln.trainer.checkpoint, kiln.trainer.membership.replica_groups). None of them names a part: a part added to
`RunState` is saved, restored, rolled back and healed with no other change.

Two kinds of part. `ModelState`, the model parts and their optimizers, is tensors: DCP's sharded files in a
commit, sent in place over the groups' process group in a heal. Every other part's `state_dict()` is plain
JSON (trainer.json in a commit: it never runs code when read back), under the part's name; `Progress` (step,
tokens_seen) sits at the top level of trainer.json, where commits have always had it. A part whose
`load_state_dict` gets None was saved before it existed. A part added with `rolls_back=False` keeps its state
through a guard's rollback (the data cursor: the offending data is skipped; the guards' own counters).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from kiln.trainer.checkpoint.state import STATE_OPTIONS, _pairs, collect_state
from kiln.trainer.rng import rng_state, set_rng_state

PROGRESS = "progress"  # the part whose keys are trainer.json's top level


def local(t: Any) -> Any:
    """This rank's shard of a (D)Tensor, detached; anything else as it is."""
    if isinstance(t, DTensor):
        return t.to_local().detach()
    return t.detach() if isinstance(t, torch.Tensor) else t


class ModelState(Stateful):
    """The model parts (pipeline stages) and their optimizers, FQN-keyed: {"model": {...}, "optim": {...}}.
    The tensors in `state_dict()` are the model's and optimizer's own (STATE_OPTIONS: no full state dict, no CPU
    offload), so a value DCP or a peer wrote into them in place is loaded already."""

    def __init__(self, parts: list[nn.Module], optimizers: list[Optimizer]):
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        return collect_state(self.parts, self.optimizers)[0]

    def load_state_dict(self, state_dict: dict[str, Any], *, unless: tuple[str, ...] = ()) -> None:
        """A tensor this run holds is copied into (nothing to do when it was loaded in place); any other value
        that differs (a setting, a tensor it lacks) goes through set_state_dict. `unless`: key suffixes of
        settings the loop sets itself before every step, not worth a set_state_dict (a heal's `.lr`)."""
        mine, keys = collect_state(self.parts, self.optimizers)
        complete = True
        with torch.no_grad():
            for part in ("model", "optim"):
                for key, value in state_dict[part].items():
                    have = mine[part].get(key)
                    if isinstance(have, torch.Tensor):
                        target, value = local(have), local(value)
                        if target.data_ptr() != value.data_ptr():
                            target.copy_(value)
                    elif isinstance(value, torch.Tensor) or (have != value and not key.endswith(unless)):
                        mine[part][key], complete = value, False
        if not complete:
            for (model, opts), (mkeys, okeys) in zip(_pairs(self.parts, self.optimizers), keys):
                set_state_dict(model, opts, model_state_dict={k: mine["model"][k] for k in mkeys},
                               optim_state_dict={k: mine["optim"][k] for k in okeys}, options=STATE_OPTIONS)

    def local_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's own tensors by part and key: where a heal is received in place."""
        state = self.state_dict()
        return {part: {k: local(v) for k, v in state[part].items() if isinstance(v, torch.Tensor)}
                for part in ("model", "optim")}


class Progress(Stateful):
    """Where the run is: the last step taken and the tokens trained on."""

    def __init__(self) -> None:
        self.step = self.tokens_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state_dict["step"]), int(state_dict["tokens_seen"])


class RngState(Stateful):
    """The random number generators of this process (kiln.trainer.rng), as JSON-safe text."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, str]:
        return rng_state(self.device)

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        set_rng_state(state_dict, self.device)


class Named(Stateful):
    """Several stateful objects under one part, each by its name (the hooks' `state`: "hooks"/<name>)."""

    def __init__(self, objects: dict[str, Any]):
        self.objects = objects

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        for name, obj in self.objects.items():
            obj.load_state_dict((state_dict or {}).get(name))


class Fixed(Stateful):
    """A record the run writes with every commit and never loads back: LoRA's base identity, which a resume
    checks before it loads anything (kiln.trainer.model.lora.check_base)."""

    def __init__(self, record: dict[str, Any]):
        self.record = record

    def state_dict(self) -> dict[str, Any]:
        return self.record

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        pass


class RunState:
    """The registry: `model` (tensors) and the JSON parts by name, in the order they are loaded (progress
    first, so a later part may read the step it resumes at)."""

    def __init__(self, model: ModelState, progress: Progress):
        self.model = model
        self.parts: dict[str, Stateful] = {PROGRESS: progress}
        self._kept: set[str] = set()  # parts a rollback leaves as they are

    def add(self, name: str, part: Stateful, *, rolls_back: bool = True) -> None:
        if name in self.parts or name in ("model", "optim", "kiln", "trainer", *self.parts[PROGRESS].state_dict()):
            raise ValueError(f"run state: part {name!r} is registered already (or reserved)")
        self.parts[name] = part
        if not rolls_back:
            self._kept.add(name)

    # -- the JSON parts: trainer.json in a commit ---------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        out = dict(self.parts[PROGRESS].state_dict())
        out.update({name: part.state_dict() for name, part in self.parts.items() if name != PROGRESS})
        return out

    def load_trainer_state(self, state: dict[str, Any], *, rollback: bool = False) -> None:
        """Every part from `state` (a commit's trainer.json, a peer's); a rollback skips the parts that keep
        theirs. Keys no part reads (a commit's "kiln" entry; "lr", "layout", "model" of older commits) are
        ignored."""
        for name, part in self.parts.items():
            if rollback and name in self._kept:
                continue
            part.load_state_dict(state if name == PROGRESS else state.get(name))

    # -- everything: what a healing peer receives ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        model = self.model.state_dict()
        return {"model": {k: local(v) for k, v in model["model"].items()},
                "optim": {k: local(v) for k, v in model["optim"].items()},
                "trainer": self.trainer_state()}

    def load_state_dict(self, state_dict: dict[str, Any], *, unless: tuple[str, ...] = ()) -> None:
        self.model.load_state_dict(state_dict, unless=unless)
        self.load_trainer_state(state_dict["trainer"])

    def digests(self) -> dict[str, str]:
        """sha256 of each part on this rank, by name: "model" and "optim" over this rank's tensors (bit-exact, by
        key), the others over their JSON. Equal state, equal digests."""
        out = {}
        for part, tensors in self.model.local_tensors().items():
            h = hashlib.sha256()
            for key in sorted(tensors):
                t = tensors[key].contiguous().cpu()
                h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            out[part] = h.hexdigest()
        for name, part in self.parts.items():
            out[name] = hashlib.sha256(json.dumps(part.state_dict(), sort_keys=True).encode()).hexdigest()
        return out

    def digest(self) -> str:
        """One sha256 over `digests()`."""
        return hashlib.sha256(json.dumps(self.digests(), sort_keys=True).encode()).hexdigest()
