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

On a GPU (`--device cuda`: bf16 and kiln's fused kernels by default) the expert GEMMs are the point:
`--grouped both` runs the MoE model twice in the alternation, its experts forced to grouped GEMMs
(`torch._grouped_mm`) and to the loop of one matmul per expert, from the same initial weights. bf16 casts the
parameters to bf16 (the dtype FSDP's mixed precision computes in; AdamW then steps them in bf16, the same for
every model). On CUDA the clock is read after `torch.cuda.synchronize()`.

    python -m tests.bench.bench_moe [--steps 20] [--out runs/bench/moe.json]
    python -m tests.bench.bench_moe --device cuda --grouped both --batch 32
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

# --grouped: which MoE models run in the alternation, by the name they are reported under, and how their experts'
# GEMMs run (None: kiln's own choice, moe.grouped_mm_runs).
MOE_RUNS = {"auto": {"tiny-moe": None}, "on": {"tiny-moe/grouped": True}, "off": {"tiny-moe/loop": False},
            "both": {"tiny-moe/grouped": True, "tiny-moe/loop": False}}


def _model(preset: str, device: torch.device, dtype: torch.dtype, grouped: bool | None = None):
    dims = resolve_model(ModelSpec(preset=preset))
    model = build_model(dims)
    model.to_empty(device=device)
    model.init_weights(0)  # the same weights for every model of a preset
    for p in model.parameters():
        p.data = p.data.to(dtype)  # parameters only, as FSDP's param_dtype; buffers (RoPE) stay as they are
    for m in model.modules():
        if isinstance(m, moe.GroupedExperts):
            m.grouped = grouped
    return dims, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def bench_steps(args, device: torch.device, dtype: torch.dtype) -> dict:
    runs = {"tiny": _model("tiny", device, dtype)}
    runs.update({name: _model("tiny-moe", device, dtype, grouped) for name, grouped in MOE_RUNS[args.grouped].items()})
    seq = runs["tiny"][0].seq_len
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (args.batch, seq + 1), generator=gen).to(device)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, (_, model, opt) in runs.items():  # alternating: the same load for all
            start = _now(device)
            model(inputs, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                rates[name].append(args.batch * seq / (_now(device) - start))
    out = {}
    for name, (dims, _, _) in runs.items():
        out[name] = {"tokens_per_s": _median_range(rates[name]), "params": count_params(dims),
                     "active_params": count_params(dims, active=True)}
    dense = out["tiny"]["tokens_per_s"]["median"]
    for name in MOE_RUNS[args.grouped]:
        key = "moe_over_dense_tokens_per_s" + ("" if name == "tiny-moe" else f" ({name.split('/')[1]})")
        out[key] = out[name]["tokens_per_s"]["median"] / dense
    if args.grouped == "both":
        out["grouped_over_loop_tokens_per_s"] = (out["tiny-moe/grouped"]["tokens_per_s"]["median"]
                                                 / out["tiny-moe/loop"]["tokens_per_s"]["median"])
    return out


def _time(fn, reps: int, device: torch.device) -> float:
    fn()  # warm
    start = _now(device)
    for _ in range(reps):
        fn()
    return (_now(device) - start) / reps


@torch.no_grad()
def bench_split(args, device: torch.device, dtype: torch.dtype) -> dict:
    dims = resolve_model(ModelSpec(preset="tiny-moe"))
    layer = build_model(dims).layers["0"].feed_forward
    layer.to_empty(device=device)
    for p in layer.parameters():
        p.data = torch.nn.init.normal_(p.data, std=0.02).to(dtype)
    c = dims.moe
    x = torch.randn(args.batch * dims.seq_len, dims.dim, device=device, dtype=dtype)
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

    grouped_runs = moe.grouped_mm_runs(device, dtype, dims.dim, c.ffn_dim)
    ms = {"routing_dispatch": _time(route, args.reps, device),
          # where torch._grouped_mm does not run (a GPU below compute capability 9.0), only the loop is timed
          "expert_gemms_grouped": _time(experts(True), args.reps, device) if grouped_runs else None,
          "expert_gemms_loop": _time(experts(False), args.reps, device), "combine": _time(combine, args.reps, device)}
    ms = {name: None if s is None else s * 1e3 for name, s in ms.items()}
    gemms = "expert_gemms_grouped" if grouped_runs else "expert_gemms_loop"
    total = ms["routing_dispatch"] + ms[gemms] + ms["combine"]
    return {"tokens": x.shape[0], "forward_ms": ms,
            f"share_of_forward_{gemms.split('_')[-1]}": {n: ms[n] / total for n in ("routing_dispatch", gemms,
                                                                                   "combine")},
            "experts_path": moe.describe(device, dtype, dims.dim, c.ffn_dim)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--kernels", default=None, choices=["fused", "reference"],
                    help="kiln's kernels switch (default: fused on cuda, reference on cpu)")
    ap.add_argument("--grouped", default="auto", choices=sorted(MOE_RUNS),
                    help="the MoE model's expert GEMMs: kiln's choice, forced grouped, forced loop, or both side by side")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="runs/bench/moe.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = args.precision or ("bf16" if cuda else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kernels.set_mode(args.kernels or ("fused" if cuda else "reference"))
    torch.manual_seed(0)
    result = {"benchmark": "moe", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "threads": torch.get_num_threads(), "batch": args.batch, "steps": args.steps, "precision": precision,
              "kernels": kernels.get_mode(), "grouped": args.grouped,
              "steps_compared": bench_steps(args, device, dtype), "moe_layer_split": bench_split(args, device, dtype)}
    write_report(result, args.out)


if __name__ == "__main__":
    main()
