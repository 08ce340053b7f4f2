"""`kiln eval` against plain PyTorch doing the same work, in the same run.

Load: kiln's `load_checkpoint` (list the commits, check every file of the step against COMMIT by size and
sha256, DCP load of the model's keys into the single-process model) vs `torch.load` + `load_state_dict` of
the same weights saved with `torch.save` (no integrity check, no resharding). Score: `mean_loss` over the
validation batches (kiln's loader, the kernels switch) vs a plain loop of `model(x)` + `F.cross_entropy` over
the same token tensors already in memory. Reported: seconds (median of --repeats), tokens/s, ratios kiln/plain.

    python -m tests.bench.bench_eval                                     # CPU, tiny preset
    python -m tests.bench.bench_eval --preset llama-1b --device cuda     # one GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kiln.api import TrainingSpec
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from kiln.trainer.evaluate import (
    initial_model,
    load_checkpoint,
    mean_loss,
    model_dims,
    validation_loader,
)
from kiln.trainer.optim import build_optimizer

from tests.bench.report import write_report


def make_spec(args) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "metadata": {"name": "bench-eval"},
        "spec": {
            "model": {"preset": args.preset},
            "data": {"uri": "builtin:pydoc"},
            "training": {"steps": 1, "globalBatchSize": args.batch, "microBatchSize": args.micro, "lr": 1e-4,
                         "precision": "fp32"},
            "parallelism": {"compile": False},
        },
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16, help="globalBatchSize (sequences per batch)")
    parser.add_argument("--micro", type=int, default=8, help="microBatchSize (rows per forward)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/eval.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    doc = make_spec(args)
    dims = model_dims(doc)

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"file://{tmp}/ckpt"
        model = initial_model(doc, dims, device)
        optimizer = build_optimizer([model], doc.spec.training, device)  # a real checkpoint carries it too
        saver = Checkpointer(doc.spec.checkpoint, default_uri=uri, rank=0, world_size=1)
        saver.save(1, [model], [optimizer], {"step": 1}, final=True)
        saver.close()
        plain_file = Path(tmp) / "model.pt"
        torch.save(model.state_dict(), plain_file)
        ckpt_bytes = sum(p.stat().st_size for p in Path(tmp, "ckpt").rglob("*") if p.is_file())

        target = initial_model(doc, dims, device)
        kiln_load = [timed(lambda: load_checkpoint(target, doc, uri), device) for _ in range(args.repeats)]
        plain_load = [timed(lambda: target.load_state_dict(torch.load(plain_file, map_location=device)), device)
                      for _ in range(args.repeats)]

    loader = validation_loader(doc, dims)
    tr = doc.spec.training
    batches = [loader.next_batch(tr.global_batch_size) for _ in range(args.batches)]
    tokens = args.batches * tr.global_batch_size * dims.seq_len

    def kiln_score():
        mean_loss(target, loader, batches=args.batches, global_batch=tr.global_batch_size,
                  micro_batch=tr.micro_batch_size, device=device)

    @torch.no_grad()
    def plain_score():
        for x, y in batches:
            for i in range(0, len(x), args.micro):
                logits = target(x[i:i + args.micro].to(device))
                F.cross_entropy(logits.flatten(0, 1).float(), y[i:i + args.micro].to(device).flatten())

    kiln_score()  # warm-up both (first-call kernel and import costs)
    plain_score()
    kiln_eval, plain_eval = [], []
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        kiln_eval.append(timed(kiln_score, device))
        plain_eval.append(timed(plain_score, device))

    med = statistics.median
    result = {
        "benchmark": "eval", "preset": args.preset, "device": str(device), "host": platform.node(),
        "checkpoint_bytes": ckpt_bytes, "tokens_scored": tokens, "repeats": args.repeats,
        "load_s": {"kiln": med(kiln_load), "plain_torch_load": med(plain_load), "all_kiln": kiln_load,
                   "all_plain": plain_load},
        "score_s": {"kiln": med(kiln_eval), "plain_loop": med(plain_eval), "all_kiln": kiln_eval,
                    "all_plain": plain_eval},
        "score_tokens_per_s": {"kiln": tokens / med(kiln_eval), "plain_loop": tokens / med(plain_eval)},
        "ratio_load_kiln_over_plain": med(kiln_load) / med(plain_load),
        "ratio_score_time_kiln_over_plain": med(kiln_eval) / med(plain_eval),
    }
    summary = {k: result[k] for k in ("checkpoint_bytes", "tokens_scored", "ratio_load_kiln_over_plain",
                                      "ratio_score_time_kiln_over_plain")}
    summary.update(load_s={k: result["load_s"][k] for k in ("kiln", "plain_torch_load")},
                   score_tokens_per_s=result["score_tokens_per_s"])
    write_report(result, args.out, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
