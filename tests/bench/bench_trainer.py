"""Throughput of kiln's trainer against a plain PyTorch loop of the same model, compiled as kiln compiles it,
in the same run.

kiln: the real training loop (`kiln.trainer.loop.train`, one process, the kernels switch, fused AdamW, its
default guards, logging and status). Reference: the same `Transformer` class with the reference kernels and
no wrapper, compiled by kiln's own `apply_compile` with kiln's decision for this layout (`compiles_whole`:
the whole model, loss included, at one fp32 process; each block where FSDP2 wraps them, as for bf16), so the
ratio does not credit torch.compile to kiln; `torch.optim.AdamW` defaults, autocast for bf16; `--no-compile`
compiles neither. Same batch, same sequence length, same number of steps (the reference twice: before and
after kiln).

Both are timed the same way: the wall time between consecutive passes through the same point of the step
(just after the optimizer step, the device synchronised), so a step's time holds everything its loop does
per step: data, forward/backward, optimizer, and kiln's guards, logging, status and checkpoint decision.
(kiln's own `tokens_per_second` leaves out the logging; it is reported beside, as `reported_by_kiln`.)
Reported: median tokens/s after warm-up (and the range), MFU where the device has a known peak, the ratio
of medians and the ratio of the fastest steps (the better estimate on a machine shared with other work).

    python -m tests.bench.bench_trainer                                   # CPU, tiny preset
    python -m tests.bench.bench_trainer --preset llama-1b --device cuda   # one GPU, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kiln.api import TrainingSpec, resolve_model
from kiln.trainer.model import kernels
from kiln.trainer.observe.metrics import flops_per_token, peak_flops
from kiln.trainer.model.transformer import build_model
from kiln.trainer.parallel.parallelize import apply_compile, compiles_whole, plan_layout
from tests.bench.report import write_report


def make_spec(args) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "metadata": {"name": "bench"},
        "spec": {
            "model": {"preset": args.preset, **({"seqLen": args.seq_len} if args.seq_len else {})},
            "data": {"uri": "synthetic"},
            "training": {"steps": args.warmup + args.steps + 1, "globalBatchSize": args.batch,
                         "microBatchSize": args.batch, "lr": 1e-4, "warmupSteps": 0, "schedule": "constant",
                         "precision": args.precision},
            "parallelism": {"compile": not args.no_compile, "kernels": args.kernels},
            "checkpoint": {"intervalSteps": 10**9},
        },
    })


def _stamp(device: torch.device, stamps: list[float]) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    stamps.append(time.perf_counter())


def _rates(stamps: list[float], tokens: int, warmup: int) -> list[float]:
    """tokens/s of each step after the warm-up, from the stamps taken at the same point of every step."""
    return [tokens / (b - a) for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]


def bench_kiln(args, out_dir: Path, device: torch.device) -> tuple[list[float], list[float]]:
    """(wall-clock tokens/s per step, the tokens/s kiln itself reported per step)."""
    from kiln.trainer.guards.hooks import GuardHooks
    from kiln.trainer.loop import StepHooks, train

    os.environ.setdefault("MASTER_PORT", "29533")
    stamps: list[float] = []
    hooks = StepHooks()
    GuardHooks().install(hooks)  # what `kiln train` runs by default
    hooks.after_update.append(lambda ctx: _stamp(device, stamps))
    spec = make_spec(args)
    train(spec, output_dir=out_dir, hooks=hooks, checkpointing=False)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = args.batch * resolve_model(spec.spec.model).seq_len
    return _rates(stamps, tokens, args.warmup), [r["tokens_per_second"] for r in records[args.warmup + 1:]]


def bench_reference(args, device: torch.device) -> list[float]:
    spec = make_spec(args).spec
    dims = resolve_model(spec.model)
    kernels.set_mode("reference")
    model = build_model(dims)
    model.to_empty(device=device)
    model.init_weights(0)
    if spec.parallelism.compile:  # as kiln decides for this layout (kiln.trainer.parallel.parallelize)
        layout = plan_layout(spec, dims, 1)
        apply_compile(model, whole=compiles_whole(layout, args.precision))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    stamps: list[float] = []
    for step in range(args.warmup + args.steps + 1):
        batch = torch.randint(0, dims.vocab_size, (args.batch, dims.seq_len + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(batch[:, :-1], batch[:, 1:])  # the model's own loss, as in kiln's loop
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loss as a number, as the trainer has it for its guards and log
        _stamp(device, stamps)
    return _rates(stamps, args.batch * dims.seq_len, args.warmup)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 on cpu, 4 on cuda)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (compilation, allocator)")
    p.add_argument("--no-compile", action="store_true", help="kiln without torch.compile")
    p.add_argument("--kernels", default="fused", choices=["fused", "reference"], help="kiln's kernels switch")
    p.add_argument("--out", default="runs/bench/trainer.json")
    args = p.parse_args(argv)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    args.batch = args.batch or (4 if args.device == "cuda" else 8)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        os.environ.setdefault("LOCAL_RANK", "0")

    dims = resolve_model(make_spec(args).spec.model)
    # The reference runs before and after kiln, so a change in machine load during the run affects both.
    ref_rates = bench_reference(args, device)
    if device.type == "cuda":
        ref_peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        kiln_rates, kiln_reported = bench_kiln(args, Path(tmp), device)
    if device.type == "cuda":
        kiln_peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    ref_rates += bench_reference(args, device)

    flops, peak = flops_per_token(dims), peak_flops(device, args.precision)  # peak None: no MFU (CPU)
    kiln_tps, ref_tps = statistics.median(kiln_rates), statistics.median(ref_rates)
    result = {
        "bench": "trainer",
        "preset": args.preset, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "precision": args.precision, "batch": args.batch, "seq_len": dims.seq_len, "steps": args.steps,
        "compile": not args.no_compile, "kernels": args.kernels, "threads": torch.get_num_threads(),
        "flops_per_token": flops, "peak_flops": peak,
        "timing": "wall time between consecutive steps at the same point, both loops",
        "kiln": {"tokens_per_second": kiln_tps, "mfu": kiln_tps * flops / peak if peak else None,
                 "tokens_per_second_min_max": [min(kiln_rates), max(kiln_rates)],
                 "tokens_per_second_each_step": kiln_rates,
                 "reported_by_kiln": {"tokens_per_second": statistics.median(kiln_reported),
                                      "excludes": "logging, status and the checkpoint decision"}},
        "reference": {"tokens_per_second": ref_tps, "mfu": ref_tps * flops / peak if peak else None,
                            "tokens_per_second_min_max": [min(ref_rates), max(ref_rates)],
                            "tokens_per_second_each_step": ref_rates},
        "ratio_kiln_over_reference": kiln_tps / ref_tps,
        # The fastest step of each is the least disturbed by other load on a shared machine.
        "ratio_best_step": max(kiln_rates) / max(ref_rates),
    }
    if device.type == "cuda":
        result["kiln"]["peak_memory_gib"] = kiln_peak_gib
        result["reference"]["peak_memory_gib"] = ref_peak_gib
    write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
