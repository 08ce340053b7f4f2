"""Gradient compression benchmark: bytes handed to all-reduce per step and final-loss delta, vs uncompressed.

Two gloo ranks on this machine train the same MLP from the same init on the same data with each mode of
`parallelism.gradientCompression` (plain replication, torch's comm hooks as `kiln.trainer.parallel.compression`
registers them). Bytes are counted at `torch.distributed.all_reduce` (what the hooks hand to the
network); the reference is the uncompressed fp32 all-reduce in the same run.

    python -m tests.bench.bench_compression [--steps 60] [--out runs/bench/compression.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.bench.report import write_report
from tests.support.ranks import run_ranks

MODES = ("none", "bf16", "powersgd")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 16))


def _run_mode(rank: int, world: int, mode: str, steps: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.trainer.parallel.compression import PowerSGDConfig, apply_replicate

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    model = _model()
    if mode == "none":  # the fp32 reference through the same Python path, so its bytes are counted too
        from torch.distributed._composable.replicate import replicate
        replicate(model, device_mesh=mesh)
        model.register_comm_hook(mesh.get_group(), default_hooks.allreduce_hook)
    else:
        apply_replicate(model, mesh, mode, PowerSGDConfig(rank=4, start_iter=2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sent = {"bytes": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kwargs)

    w_true = torch.randn(128, 16, generator=torch.Generator().manual_seed(7)) / 8
    losses, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 128, generator=g)
        y = torch.tanh(x @ w_true)
        loss = torch.nn.functional.mse_loss(model(x), y)
        before = sent["bytes"]
        dist.all_reduce = counting_all_reduce
        try:
            loss.backward()
        finally:
            dist.all_reduce = real_all_reduce
        step_bytes = sent["bytes"] - before
        opt.step()
        opt.zero_grad()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / world)
    # steady-state bytes: the last step (PowerSGD sends plain all-reduces during its warm start)
    return {"bytes_per_step": step_bytes, "final_loss": sum(losses[-10:]) / 10,
            "seconds": time.perf_counter() - t0}


def _worker(rank, world, steps):
    return {mode: _run_mode(rank, world, mode, steps) for mode in MODES}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/compression.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        modes = run_ranks(_worker, args.world, Path(tmp), args.steps, start="spawn")[0]
    ref = modes["none"]
    report = {
        "benchmark": "compression", "world": args.world, "steps": args.steps,
        "params": sum(p.numel() for p in _model().parameters()),
        "reference": "none (fp32 all-reduce), same run",
        "modes": {m: {**v, "bytes_ratio_vs_none": ref["bytes_per_step"] / v["bytes_per_step"],
                      "final_loss_rel_delta": (v["final_loss"] - ref["final_loss"]) / ref["final_loss"]}
                  for m, v in modes.items()},
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
