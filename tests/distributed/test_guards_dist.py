"""Guards in real torch.distributed jobs (gloo, several processes): NaN skip, spike rollback, SDC detection
(replica comparison, and the seal in kiln's training loop under every layout)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from kiln.trainer.guards.sdc import SdcCheck, SilentDataCorruption
from kiln.trainer.guards.step import Action, GuardConfig, StepGuard, global_scalars
from tests.support.ranks import run_ranks
from tests.support.runs import read_metrics, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical replicas, as a broadcast from rank 0 would give
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _guarded_training(rank, world, steps, inject):
    """A DDP loop with the guard hooks where the trainer calls them; `inject[step]` poisons rank 1's loss."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard, sdc = StepGuard(GuardConfig(min_history=4, spike_limit=3, spike_window=10)), SdcCheck(every=5)
    gen = torch.Generator().manual_seed(100 + rank)
    log = []
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        factor = inject.get(str(step), 1.0) if rank == 1 else 1.0
        (loss * factor).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        before = _flat(model).clone()
        g_loss, g_norm = global_scalars(loss * factor, norm)
        d = guard.check(step, g_loss, g_norm)
        if d.action is Action.OK:
            opt.step()
        opt.zero_grad()
        if sdc.due(step):
            sdc.verify(model, step, loss=g_loss)
        log.append({"step": step, "action": d.action.value, "skip_data": d.skip_data,
                    "changed": not torch.equal(before, _flat(model))})
    return {"log": log, "metrics": guard.metrics(), "sdc": sdc.metrics(),
            "final": _flat(model).tolist()}


def test_nan_skips_everywhere_and_spike_series_requests_rollback(tmp_path):
    # rank 1 alone sees a NaN at step 6 and huge losses at 9, 11, 13; the decisions must be global.
    res = run_ranks(_guarded_training, 2, tmp_path, 14, {"6": math.nan, "9": 1e4, "11": 1e4, "13": 1e4},
                    start="spawn")
    for r in res:
        by_step = {e["step"]: e for e in r["log"]}
        assert by_step[6]["action"] == "skip" and not by_step[6]["changed"]
        assert [by_step[s]["action"] for s in (9, 11, 13)] == ["skip", "skip", "rollback"]
        assert by_step[13]["skip_data"] == [9, 13]
        assert not any(by_step[s]["changed"] for s in (6, 9, 11, 13))
        assert all(e["action"] == "ok" and e["changed"] for s, e in by_step.items() if s not in (6, 9, 11, 13))
        m = r["metrics"]
        assert (m["guard_skipped_nonfinite"], m["guard_skipped_spike"], m["guard_rollbacks"]) == (1, 2, 1)
        assert r["sdc"] == {"sdc_checks": 2, "sdc_mismatches": 0}  # real DDP steps keep replicas identical
        assert all(math.isfinite(v) for v in r["final"])
    assert res[0]["log"] == res[1]["log"] and res[0]["final"] == res[1]["final"]


def _flip_one_bit(t: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        flat = t.view(-1).view(torch.int32)
        flat[index] ^= (1 << bit)


def _sdc_replicated(rank, world, bad_rank):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    sdc = SdcCheck(every=1)
    out = {}

    def attempt(step, loss=None):
        try:
            sdc.verify(model, step, loss=loss)
        except SilentDataCorruption as e:
            return {"ranks": e.ranks, "msg": str(e)}
        return None

    out["clean"] = attempt(1, loss=2.5)
    for step, bit in ((2, 0), (3, 30)):  # the lowest mantissa bit and a high exponent bit
        if rank == bad_rank:
            _flip_one_bit(model.module[2].weight.data, 7, bit)
        out[f"bit{bit}"] = attempt(step)
        if rank == bad_rank:
            _flip_one_bit(model.module[2].weight.data, 7, bit)  # undo
    out["loss"] = attempt(4, loss=2.5000001 if rank == 0 else 2.5)
    out["mismatches"] = sdc.mismatches
    return out


def test_sdc_in_a_ddp_replica_is_detected_named_and_stops_every_rank(tmp_path):
    res = run_ranks(_sdc_replicated, 3, tmp_path, 2, start="spawn")
    for r in res:
        assert r["clean"] is None
        for step, bit in ((2, 0), (3, 30)):
            hit = r[f"bit{bit}"]
            assert hit is not None, "every rank must stop, not only the corrupted one"
            assert hit["ranks"] == [2] and f"step {step}" in hit["msg"] and "module.2.weight" in hit["msg"]
        assert r["loss"]["ranks"] == [0] and "loss differs" in r["loss"]["msg"]
        assert r["mismatches"] == 3


def _sdc_hsdp(rank, world, bad_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sdc = SdcCheck(every=1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 4):  # real HSDP steps keep the replicas bit-identical
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sdc.verify(model, step)
    if rank == bad_rank:
        _flip_one_bit(model[0].weight.to_local(), 3, 12)
    try:
        sdc.verify(model, 4)
    except SilentDataCorruption as e:
        return {"raised": True, "ranks": e.ranks, "msg": str(e)}
    return {"raised": False}


def test_flipped_bit_in_an_hsdp_shard_names_its_replica_pair(tmp_path):
    # mesh [[0, 1], [2, 3]]: rank 3's shard has exactly one other copy, on rank 1; with two copies
    # there is no majority, so both holders are named and every rank stops.
    res = run_ranks(_sdc_hsdp, 4, tmp_path, 3, start="spawn")
    for r in res:
        assert r["raised"] and r["ranks"] == [1, 3]
        assert "0.weight" in r["msg"] and "[1, 3]" in r["msg"]


FLIP_STEP = 3  # with sdc_every=3: sealed after step 2's update, verified before step 3's


def _flip_in_training(rank, world, spec_path, out, bad_rank):
    """kiln's training loop with the default guards (SDC every 3 steps); at reported step FLIP_STEP, after
    backward, one bit of `bad_rank`'s shard of its first attention.wq flips, as a fault in memory would."""
    from torch.distributed.tensor import DTensor

    from kiln.api.load import load_file
    from kiln.trainer.guards.hooks import GuardHooks
    from kiln.trainer.loop import StepHooks, train

    seen = {}

    def flip(ctx):
        if ctx.step == FLIP_STEP:  # the guards chose their replica group at step 1 (this hook runs before theirs)
            seen["sdc_line"] = guards.sdc.describe(ctx.model_parts)
        if ctx.step == FLIP_STEP and rank == bad_rank:
            p = next(p for n, p in ctx.model_parts[0].named_parameters() if n.endswith("attention.wq.weight"))
            _flip_one_bit((p.to_local() if isinstance(p, DTensor) else p).detach(), 5, 30)
        return True

    hooks = StepHooks(before_update=[flip])  # before the guards' hooks: the flip lands after the seal
    guards = GuardHooks(sdc_every=3, health_interval_s=0)
    guards.install(hooks)
    try:
        train(load_file(spec_path)[0], output_dir=Path(out), hooks=hooks)
    except SilentDataCorruption as e:
        return {"step": e.step, "ranks": e.ranks, "msg": str(e), "sdc": guards.sdc.metrics(), **seen}
    return {"step": None}


NO_COPIES = "no replicated copies to compare in this layout"


@pytest.mark.parametrize("layout,world,bad_rank,replicas", [
    ({}, 2, 1, NO_COPIES),  # plain FSDP: no rank holds a second copy of a shard
    ({"tensor": 2}, 2, 0, "copies compared across tp"),  # wq is split by columns; only the norms are copies
    ({"replicate": 2}, 4, 3, "copies compared across dp_replicate"),  # rank 1 holds a copy; the seal names 3
    ({"pipeline": 2}, 2, 1, NO_COPIES),  # each stage's layers live on one rank
], ids=["fsdp", "tp", "hsdp", "pp"])


def test_a_flipped_bit_is_caught_in_every_layout_and_names_its_rank(tmp_path, layout, world, bad_rank, replicas):
    spec = write_spec(tmp_path / "spec.yaml", training={"steps": 5}, parallelism=layout, nproc=world)
    out = tmp_path / "out"
    results = run_ranks(_flip_in_training, world, out, str(spec), str(out), bad_rank, start="spawn", init=False)
    for r in results:  # every rank stops at the flip's step, none goes on to commit it
        assert r["step"] == FLIP_STEP and r["ranks"] == [bad_rank], r
        assert re.search(rf"rank {bad_rank}: layers\.\d\.attention\.wq\.weight", r["msg"]), r["msg"]
        assert r["sdc"] == {"sdc_checks": 1, "sdc_mismatches": 1}  # step 3's check is the run's first
        assert f"against their seal from the previous step's update (held by all {world} rank(s)); {replicas}" \
            in r["sdc_line"], r["sdc_line"]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))
