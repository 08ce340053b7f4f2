"""The run's state registry (kiln.trainer.state) in one process: a commit through the real Checkpointer, a guard's
rollback and a peer's heal each carry every registered part, a new part included, and nothing else; a commit
written before the registry (with `lr`, `layout`, `model`, without goodput or hook state) still loads."""

from __future__ import annotations

import json

import torch
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.storage import FileStore
from kiln.storage.commit import read_commit, write_commit
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from kiln.trainer.observe.status_report import StatusReporter
from kiln.trainer.state import ModelState, Named, Progress, RngState, RunState
from tests.state_parts import Counter


class Cursor(Counter):
    """Stands in for the data loader: kept through a rollback."""


def build(seed: int, *, extra: bool = True) -> tuple[RunState, dict]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = RunState(ModelState([model], [opt]), Progress())
    objs = {"model": model, "opt": opt, "cursor": Cursor(), "guard": Counter(), "goodput": StatusReporter(10),
            "counter": Counter()}
    state.add("data", objs["cursor"], rolls_back=False)
    state.add("rng", RngState(torch.device("cpu")))
    state.add("hooks", Named({"guards": objs["guard"]}), rolls_back=False)
    state.add("goodput", objs["goodput"], rolls_back=False)
    if extra:
        state.add("counter", objs["counter"])  # the new part: no other change anywhere
    return state, objs


def step(state: RunState, objs: dict, n: int) -> None:
    """One training step that moves every part."""
    model, opt = objs["model"], objs["opt"]
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()  # draws from the RNG
    opt.step()
    state.parts["progress"].step = n
    state.parts["progress"].tokens_seen += 128
    for name in ("cursor", "guard", "counter"):
        objs[name].n += 1
    objs["goodput"].update({"step": n, "step_s": 0.5}, None)


def checkpointer(root) -> Checkpointer:
    return Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=0, world_size=1)


def save(ck: Checkpointer, state: RunState, n: int) -> None:
    """As kiln.trainer.run saves: the model part's tensors and the trainer state."""
    ck.save(n, state.model.parts, state.model.optimizers, state.trainer_state())
    ck.wait()


def restore(ck: Checkpointer, state: RunState, *, rollback: bool = False) -> None:
    saved = ck.restore(state.model.parts, state.model.optimizers)
    state.load_trainer_state(saved, rollback=rollback)


def test_a_commit_restored_into_a_fresh_registry_has_the_same_digest(tmp_path):
    state, objs = build(0)
    for n in range(1, 4):
        step(state, objs, n)
    ck = checkpointer(tmp_path)
    save(ck, state, 3)
    want = state.digest()
    draw = torch.rand(4)  # what the saved run draws next
    ck.close()
    saved = json.loads((tmp_path / "step-00000003" / "trainer.json").read_text())
    assert saved["counter"] == {"n": 3} and saved["step"] == 3  # the new part is in the commit, by its name
    assert not {"lr", "layout", "model"} & set(saved)  # fields nothing read are no longer written

    fresh, fresh_objs = build(1)
    torch.manual_seed(99)  # another RNG stream, until the restore sets it back
    assert fresh.digest() != want
    restore(checkpointer(tmp_path), fresh)
    assert fresh.digest() == want
    assert fresh_objs["counter"].n == 3 and fresh_objs["goodput"].state_dict() == objs["goodput"].state_dict()
    assert torch.equal(torch.rand(4), draw)  # the restored run draws what the saved one would have


def test_a_rollback_restores_every_part_but_those_it_keeps(tmp_path):
    state, objs = build(0)
    ck = checkpointer(tmp_path)
    step(state, objs, 1)
    save(ck, state, 1)
    weights = [p.detach().clone() for p in objs["model"].parameters()]
    step(state, objs, 2)
    step(state, objs, 3)
    restore(ck, state, rollback=True)
    ck.close()
    assert state.parts["progress"].step == 1 and state.parts["progress"].tokens_seen == 128
    assert objs["counter"].n == 1  # the new part rolls back with the weights
    assert all(torch.equal(a, b) for a, b in zip(objs["model"].parameters(), weights))
    assert objs["cursor"].n == 3 and objs["guard"].n == 3  # kept: the spiking data is skipped, the guards count on
    assert objs["goodput"].state_dict()["productive_s"] == 1.5


def test_a_heal_carries_every_part_into_the_receivers_own_tensors():
    peer, peer_objs = build(0)
    for n in range(1, 6):
        step(peer, peer_objs, n)
    behind, objs = build(1)
    step(behind, objs, 1)
    own = behind.model.local_tensors()  # where kiln.trainer.membership.replica_groups receives a heal in place
    sent = peer.state_dict()
    for part, tensors in own.items():  # what torchft's PGTransport does: the sender's values into these tensors
        for key, t in tensors.items():
            t.copy_(sent[part][key])
    behind.load_state_dict({**sent, "model": dict(own["model"]), "optim": dict(own["optim"])}, unless=(".lr",))
    assert behind.digest() == peer.digest()
    assert objs["counter"].n == 5 and objs["cursor"].n == 5 and behind.parts["progress"].step == 5
    assert all(a is b or a.data_ptr() == b.data_ptr()
               for a, b in zip(own["model"].values(), behind.model.local_tensors()["model"].values()))


def test_a_commit_from_before_the_registry_still_loads(tmp_path):
    """trainer.json as kiln wrote it before: with lr, layout and model, no goodput, no hooks, no new part."""
    old, objs = build(0, extra=False)
    step(old, objs, 1)
    ck = checkpointer(tmp_path)
    save(ck, old, 1)
    ck.close()
    store = FileStore(tmp_path)
    legacy = {"step": 1, "tokens_seen": 128, "data": {"n": 1}, "rng": old.parts["rng"].state_dict(), "lr": 0.01,
              "layout": {"dp_shard": 1, "tp": 1, "pp": 1}, "model": {"dim": 8}, "kiln": {"step": 1, "final": True}}
    files = read_commit(store, 1).files
    write_commit(store, 1, {n: e for n, e in files.items() if n != "trainer.json"}, legacy)

    fresh, fresh_objs = build(1)
    restore(checkpointer(tmp_path), fresh)
    assert fresh.parts["progress"].step == 1 and fresh_objs["cursor"].n == 1
    assert fresh_objs["counter"].n == 0 and fresh_objs["guard"].n == 0  # saved before them: load(None)
    assert fresh_objs["goodput"].state_dict()["productive_s"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(fresh_objs["model"].parameters(), objs["model"].parameters()))
