"""A heal receives only what a peer of the run's layout would send (kiln.trainer.membership.heal_guard): over
torchft's own gloo process group and its PGTransport (the path a healing group takes), a peer that declares a
huge description, a description that would run code, or tensors beyond the run's state is refused with one line
before the receiver allocates or unpickles anything, and the same receiver then heals from an honest peer."""

from __future__ import annotations

import os
import pickle
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport, _StateDictMeta, _TensorMeta

from kiln.trainer.membership.heal_guard import GuardedPG, HealRefused, StateSize
from kiln.trainer.state import ModelState, Progress, RunState

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(seconds=30)
STEP = 7


def run_state(seed: int) -> RunState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    return RunState(ModelState([model], [torch.optim.AdamW(model.parameters(), lr=1e-3)]), Progress())


@pytest.fixture(scope="module")
def pgs():
    """Two ranks of torchft's gloo process group in this process (one thread each), as two groups' ranks are."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pair = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]
    threads = [threading.Thread(target=pair[r].configure, args=(f"127.0.0.1:{store.port}/heal", f"g{r}", r, 2))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield pair
    for pg in pair:
        pg.shutdown()


def sending(fn) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - shown by the test
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.errors = errors
    thread.start()
    return thread


def receive(pg, state: RunState):
    transport = PGTransport(GuardedPG(pg, state), timeout=TIMEOUT, device=torch.device("cpu"),
                            state_dict=lambda: {"user": {"kiln": state.model.local_tensors()}})
    return transport.recv_checkpoint(src_rank=0, metadata="<n/a>", step=STEP, timeout=TIMEOUT)


def send_raw(pg, description: bytes, length: int | None = None) -> None:
    """What a lying peer sends: a length (tag 1) and a description (tag 2), as PGTransport frames them."""
    pg.send([torch.tensor([length if length is not None else len(description)], dtype=torch.int64)], 1,
            tag=1).wait(TIMEOUT)
    if length is None:
        pg.send([torch.frombuffer(bytearray(description), dtype=torch.uint8)], 1, tag=2).wait(TIMEOUT)


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_lying_peer_is_refused_before_allocation_and_an_honest_one_heals(pgs, tmp_path):
    receiver, sender = run_state(1), run_state(2)
    size = StateSize(receiver)

    # a description length of 1 TiB: refused from the length alone, nothing allocated
    peer = sending(lambda: send_raw(pgs[0], b"", length=1 << 40))
    with pytest.raises(HealRefused, match=rf"declares a state description of {1 << 40} bytes; .* at most "
                                          rf"{size.description_bytes} .*refused before allocating it"):
        receive(pgs[1], receiver)
    peer.join()

    # a description that would run code: refused by kiln's unpickler, torchft's pickle.loads never sees it
    marker = tmp_path / "ran"
    peer = sending(lambda: send_raw(pgs[0], pickle.dumps(RunsCode(marker))))
    with pytest.raises(HealRefused, match=r"describes its state with (posix|os)\.system, .*refused without unpickling"):
        receive(pgs[1], receiver)
    peer.join()
    assert not marker.exists()

    # a well-formed description declaring a 1 TiB tensor the receiver does not hold
    huge = _StateDictMeta(step=STEP, treespec=None, paths=[()], non_tensor_leaves=[
        _TensorMeta(shape=torch.Size([1 << 40]), dtype=torch.uint8, storage_offset=0, stride=(1,), nbytes=1 << 40)])
    peer = sending(lambda: send_raw(pgs[0], pickle.dumps(huge)))
    with pytest.raises(HealRefused, match=rf"declares 1 tensors of {1 << 40} bytes; this rank's state is "
                                          rf"{size.tensors} tensors of {size.tensor_bytes} bytes"):
        receive(pgs[1], receiver)
    peer.join()

    # the same receiver, the same process group: an honest peer's heal goes through, every tensor in place
    sent = {"user": {"kiln": sender.state_dict()}, "torchft": {"step": STEP, "batches_committed": STEP}}
    peer = sending(lambda: PGTransport(pgs[0], timeout=TIMEOUT, device=torch.device("cpu")).send_checkpoint(
        [1], STEP, sent, TIMEOUT))
    got = receive(pgs[1], receiver)
    peer.join()
    assert not peer.errors, peer.errors
    receiver.load_state_dict(got["user"]["kiln"])
    assert receiver.digests()["model"] == sender.digests()["model"]
    assert receiver.digests()["optim"] == sender.digests()["optim"]
