"""A mixture-of-experts training step against the dense model with the same active parameters per token, in the
same run, and where an MoE layer's forward time goes.

Models: the `tiny-moe` preset (8 experts of hidden 176, top-2: 2 x 176 = 352 active hidden units per token) and
the dense `tiny` preset (one MLP of hidden 352), the same attention, embedding and output. Each step is a
forward/backward of a batch of `--batch` x seqLen tokens and a torch.optim.AdamW step, fp32, no compile, the
reference kernels (what runs on a CPU); the two models' steps alternate, so both see the same machine load.
Reported: median tokens/s (and the range) of each, their ratio, and the parameter counts (total and active).

The split: one MoE layer of the preset (a (batch x seqLen, dim) input), forward only, each phase timed on its own
over `--reps` repetitions: routing + dispatch (router GEMM, softmax, top-k, the sort by expert and the gather of the
rows), the expert GEMMs (GroupedExperts on the sorted rows: grouped GEMMs and, for reference, the loop), and the
combine (the unsort and the weighted sum over the k slots). Backward is not split (its autograd ops are not
attributed to the phases).

    python -m tests.bench.bench_moe [--steps 20] [--out runs/bench/moe.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.api import resolve_model
from kiln.api.spec import ModelSpec
from kiln.trainer.model import kernels, moe
from kiln.trainer.model.transformer import build_model, count_params
from tests.bench.report import write_report


def _model(preset: str):
    dims = resolve_model(ModelSpec(preset=preset))
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return dims, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_steps(args) -> dict:
    runs = {name: _model(name) for name in ("tiny", "tiny-moe")}
    seq = runs["tiny"][0].seq_len
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (args.batch, seq + 1), generator=gen)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, (_, model, opt) in runs.items():  # alternating: the same load for both
            start = time.perf_counter()
            model(inputs, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                rates[name].append(args.batch * seq / (time.perf_counter() - start))
    out = {}
    for name, (dims, _, _) in runs.items():
        out[name] = {"tokens_per_s": _median_range(rates[name]), "params": count_params(dims),
                     "active_params": count_params(dims, active=True)}
    out["moe_over_dense_tokens_per_s"] = out["tiny-moe"]["tokens_per_s"]["median"] / out["tiny"]["tokens_per_s"]["median"]
    return out


def _time(fn, reps: int) -> float:
    fn()  # warm
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


@torch.no_grad()
def bench_split(args) -> dict:
    dims = resolve_model(ModelSpec(preset="tiny-moe"))
    layer = build_model(dims).layers["0"].feed_forward
    layer.to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    c = dims.moe
    x = torch.randn(args.batch * dims.seq_len, dims.dim)
    k = c.top_k

    def route():
        _, weights, chosen = layer.router(x)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=c.experts)
        return weights, order, counts, x[order // k]

    weights, order, counts, rows = route()
    out_rows = layer.experts(rows, counts)

    def experts(grouped: bool):
        layer.experts.grouped = grouped
        return lambda: layer.experts(rows, counts)

    def combine():
        unsorted = torch.empty_like(out_rows).index_copy_(0, order, out_rows)
        return (unsorted.view(-1, k, dims.dim) * weights.unsqueeze(-1)).sum(1)

    ms = {"routing_dispatch": _time(route, args.reps), "expert_gemms_grouped": _time(experts(True), args.reps),
          "expert_gemms_loop": _time(experts(False), args.reps), "combine": _time(combine, args.reps)}
    ms = {name: s * 1e3 for name, s in ms.items()}
    total = ms["routing_dispatch"] + ms["expert_gemms_grouped"] + ms["combine"]
    return {"tokens": x.shape[0], "forward_ms": ms,
            "share_of_forward_grouped": {n: ms[n] / total for n in ("routing_dispatch", "expert_gemms_grouped",
                                                                     "combine")},
            "experts_path": moe.describe(torch.device("cpu"), torch.float32, dims.dim, c.ffn_dim)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="runs/bench/moe.json")
    args = ap.parse_args()
    kernels.set_mode("reference")
    torch.manual_seed(0)
    result = {"benchmark": "moe", "device": "cpu", "threads": torch.get_num_threads(), "batch": args.batch,
              "steps": args.steps, "precision": "fp32", "steps_compared": bench_steps(args),
              "moe_layer_split": bench_split(args)}
    write_report(result, args.out)


if __name__ == "__main__":
    main()
