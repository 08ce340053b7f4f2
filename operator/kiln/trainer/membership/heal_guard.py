"""What a healing group accepts from the peer it heals from (issue 28, authenticated healing).

torchft's PGTransport receives a heal in three parts over the groups' process group: the length of the
sender's description of its state (tag 1), which it allocates; the description itself (tag 2), which it
unpickles (pickle runs code); then each tensor the description declares (tags 3+), allocating the ones this
group does not hold in place. A peer that lies could make the receiver allocate any size it names, or run code.

`GuardedPG` is the process group PGTransport receives through: it lets each receive complete, then checks what
arrived before torchft acts on it, against the size of this rank's own state (kiln.trainer.state: a peer of
the same layout sends exactly as many tensor bytes, and a description of the same shape):

- the declared description length: at most DESCRIPTION_PER_TENSOR per tensor, twice this rank's JSON parts
  and DESCRIPTION_SLACK; refused before torchft allocates it;
- the description: unpickled by kiln first with only the globals torchft's description is made of (its
  dataclasses, torch.Size, dtypes, pytree's spec and keys); anything else is refused before torchft's
  `pickle.loads` sees it; its tensors may total at most this rank's own tensor bytes.

A refusal raises HealRefused, which torchft's manager reports as the step's error: the step is not committed
and the next quorum tries again; the receiving process keeps running.
"""

from __future__ import annotations

import io
import json
import pickle
from datetime import timedelta
from typing import Any, Callable

import torch

from kiln.errors import KilnError
from kiln.trainer.state import RunState

DESCRIPTION_PER_TENSOR = 4096  # a tensor's path, shape, stride, dtype and tree node: a few hundred bytes
DESCRIPTION_SLACK = 1 << 20

# Everything torchft's description of a state of local tensors refers to (kiln sends no DTensor: RunState's
# state_dict holds each rank's local shards).
DESCRIPTION_GLOBALS = {
    "torchft.checkpointing.pg_transport": {"_StateDictMeta", "_TensorMeta"},
    "torch.utils._pytree": {"TreeSpec", "LeafSpec", "treespec_leaf", "MappingKey", "SequenceKey", "GetAttrKey"},
    "torch": {"Size"},
    "builtins": {"dict", "tuple", "list"},
}


class HealRefused(KilnError):
    """A heal's data that a peer of this run's layout would not send: refused before it is allocated or run."""


class StateSize:
    """This rank's state as a heal moves it: its tensors (count, bytes of their storages, which PGTransport
    sends whole) and its JSON parts' size."""

    def __init__(self, state: RunState):
        tensors = [t for part in state.model.local_tensors().values() for t in part.values()]
        self.tensors = len(tensors)
        self.tensor_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
        self.json_bytes = len(json.dumps(state.trainer_state()))

    @property
    def description_bytes(self) -> int:
        return DESCRIPTION_PER_TENSOR * self.tensors + 2 * self.json_bytes + DESCRIPTION_SLACK


class _DescriptionUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, src: int):
        super().__init__(io.BytesIO(data))
        self.src = src

    def find_class(self, module: str, name: str):
        if name in DESCRIPTION_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise HealRefused(f"replica groups: the heal from peer rank {src_label(self.src)} describes its state with "
                          f"{module}.{name}, which a kiln peer never sends: refused without unpickling it")


def src_label(src: int) -> str:
    return f"{src} (replica rank in the groups' process group)"


def check_length(length: int, size: StateSize, src: int) -> None:
    if not 0 < length <= size.description_bytes:
        raise HealRefused(
            f"replica groups: the heal from peer rank {src_label(src)} declares a state description of {length} "
            f"bytes; this run's state is described in at most {size.description_bytes} ({size.tensors} tensors, "
            f"{size.json_bytes} bytes of JSON parts): refused before allocating it")


def check_description(data: bytes, size: StateSize, src: int) -> None:
    try:
        meta = _DescriptionUnpickler(data, src).load()
    except HealRefused:
        raise
    except Exception as err:  # noqa: BLE001 - garbled bytes: say so
        raise HealRefused(f"replica groups: the heal from peer rank {src_label(src)} is not a state description "
                          f"({type(err).__name__}: {err})") from None
    leaves = getattr(meta, "non_tensor_leaves", None)
    if not isinstance(leaves, list):
        raise HealRefused(f"replica groups: the heal from peer rank {src_label(src)} is not a state description "
                          f"(it holds a {type(meta).__name__})")
    declared = [getattr(leaf, "nbytes", 0) for leaf in leaves if type(leaf).__name__ == "_TensorMeta"]
    if not all(isinstance(n, int) and n >= 0 for n in declared) or sum(declared) > size.tensor_bytes:
        raise HealRefused(
            f"replica groups: the heal from peer rank {src_label(src)} declares {len(declared)} tensors of "
            f"{sum(n for n in declared if isinstance(n, int))} bytes; this rank's state is {size.tensors} tensors "
            f"of {size.tensor_bytes} bytes: refused before allocating them")


class _Checked:
    """A receive's Work whose wait() checks what arrived before returning it to torchft."""

    def __init__(self, work: Any, check: Callable[[], None]):
        self._work, self._check = work, check

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._check()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class GuardedPG:
    """The groups' process group as PGTransport sees it: sends pass through; the heal's length (tag 1) and
    description (tag 2) are checked on arrival against `state`'s size, measured when the length arrives."""

    LENGTH, DESCRIPTION = 1, 2  # PGTransport's tags

    def __init__(self, pg: Any, state: RunState):
        self._pg, self._state = pg, state
        self._size: StateSize | None = None

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._pg.send(tensors, dst, tag=tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        work = self._pg.recv(tensors, src, tag=tag)
        if tag == self.LENGTH:
            def check() -> None:
                self._size = StateSize(self._state)
                check_length(int(tensors[0].item()), self._size, src)
            return _Checked(work, check)
        if tag == self.DESCRIPTION:
            return _Checked(work, lambda: check_description(
                tensors[0].cpu().numpy().tobytes(), self._size or StateSize(self._state), src))
        return work
