"""A checkpoint item that would run code, in the shard of one rank of two (real gloo ranks, FSDP2): every
rank refuses the restore with the same KilnError naming that shard, and nothing runs (issue 13, item 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.forged_checkpoints import RunsCommand, redirect_item, torch_blob
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]


def _worker(rank, world, root, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kiln.api.spec import CheckpointSpec
    from kiln.errors import KilnError
    from kiln.trainer.checkpoint.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=rank, world_size=world)
    try:
        if mode == "save":
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            ck.save(1, [model], [opt], {"step": 1}, final=True)
            return {"saved": True}
        try:
            ck.restore([model], [opt])
        except KilnError as err:
            return {"error_text": str(err)}
        return {"restored": True}
    finally:
        ck.close()


def test_an_unsafe_item_in_one_ranks_shard_is_refused_by_every_rank(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "ran"
    run_ranks(_worker, 2, tmp_path / "save", str(root), "save")
    shard = redirect_item(root, 1, "model.0.weight", torch_blob(RunsCommand(marker)), in_file="__1_")

    results = run_ranks(_worker, 2, tmp_path / "restore", str(root), "restore")
    for rank, got in enumerate(results):
        assert "error_text" in got, (rank, got)
        assert f"file://{root}/step-00000001/{shard}" in got["error_text"] and "run code" in got["error_text"], got
    assert not marker.exists(), "the checkpoint ran code"
