"""Save with FSDP2 at dp=2, resume at dp=1 and at tp=2 (real gloo processes): the same weights and optimizer
state come back, and the next training step continues exactly as the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]

DIM, HIDDEN, OUT, BATCH = 16, 32, 8, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, OUT, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    snap = {f"model.{k}": _full(v) for k, v in msd.items()}
    snap.update({f"optim.{k}": _full(v) for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return snap


def _build(layout: str, rank: int, world: int):
    """The same model in three layouts: plain (dp=1), FSDP2 over dp, tensor parallel over tp."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, step: int, layout: str, rank: int, world: int) -> float:
    x, y = _batch(step)
    if layout == "fsdp":  # each data-parallel rank takes its slice of the global batch
        per = BATCH // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    if layout == "fsdp":
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
    return float(loss)


def _worker(rank, world, root, layout, mode, result_path):
    from kiln.api.spec import CheckpointSpec
    from kiln.trainer.checkpoint.checkpointer import Checkpointer

    model, opt = _build(layout, rank, world)
    ck = Checkpointer(
        CheckpointSpec(uri=f"file://{root}", interval_steps=3), default_uri="", rank=rank, world_size=world
    )
    out = {}
    if mode == "save":
        for step in range(1, 4):
            _train_step(model, opt, step, layout, rank, world)
            if ck.should_save(step):
                ck.save(step, [model], [opt], {"step": step})
        ck.wait()
        out["at3"] = _snapshot(model, opt)
        out["loss4"] = _train_step(model, opt, 4, layout, rank, world)
        out["at4"] = _snapshot(model, opt)
    else:
        state = ck.restore([model], [opt])
        out["restored_step"] = state["step"]
        out["at3"] = _snapshot(model, opt)
        out["loss4"] = _train_step(model, opt, 4, layout, rank, world)
        out["at4"] = _snapshot(model, opt)
        if rank == 0 and mode == "resume-tp-and-dp1":
            # the same checkpoint into one plain process (dp=1), no process group involved
            plain, popt = _build("plain", 0, 1)
            solo = Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=0, world_size=1)
            dp1 = {"restored_step": solo.restore([plain], [popt])["step"], "at3": _snapshot(plain, popt)}
            dp1["loss4"] = _train_step(plain, popt, 4, "plain", 0, 1)
            dp1["at4"] = _snapshot(plain, popt)
            out["dp1"] = dp1
            solo.close()
    ck.close()
    if rank == 0:
        torch.save(out, result_path)


def _run(world, root, layout, mode, tmp_path) -> dict:
    path = str(tmp_path / f"{layout}-{world}-{mode}.pt")
    run_ranks(_worker, world, tmp_path / f"ranks-{layout}-{mode}", str(root), layout, mode, path)
    return torch.load(path)


def _assert_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.slow
def test_save_at_dp2_resume_at_dp1_and_tp2(tmp_path):
    root = tmp_path / "ckpt"
    saved = _run(2, root, "fsdp", "save", tmp_path)
    assert (root / "step-00000003" / "COMMIT").exists()
    assert {p.name for p in (root / "step-00000003").glob("__*_*.distcp")} >= {"__0_0.distcp", "__1_0.distcp"}

    tp2 = _run(2, root, "tp", "resume-tp-and-dp1", tmp_path)
    dp1 = tp2.pop("dp1")
    for name, got in (("dp=1", dp1), ("tp=2", tp2)):
        assert got["restored_step"] == 3
        _assert_close(got["at3"], saved["at3"], f"{name} restored state")
        # the next step continues the uninterrupted run: same loss, same weights and moments after it
        assert got["loss4"] == pytest.approx(saved["loss4"], rel=1e-5)
        _assert_close(got["at4"], saved["at4"], f"{name} after one more step")
