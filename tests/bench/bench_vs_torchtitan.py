"""Throughput of kiln's trainer against TorchTitan's Llama3 model on the same work, interleaved in one run.

kiln (A): the real training loop (`kiln.trainer.loop.train`, one process: what `kiln.trainer.parallel.parallelize` applies
at that layout — at one rank in fp32 no FSDP and the whole model compiled as one graph —, the kernels switch,
its default guards, logging and status). TorchTitan (B), its best configuration of the same model by default:
`torchtitan` 0.3.0's Llama3 model (fused QKV projection, complex RoPE) compiled as one graph with its loss
(as kiln compiles its own model at one rank), or with `--torchtitan 0.2.2` that release's model (separate
q/k/v) compiled per block by TorchTitan's own `apply_compile` with its loss compiled, as its trainer does.
Its step either way: forward, sum cross-entropy over the tokens, backward, clipping at 1.0, AdamW with
TorchTitan's defaults (fused), the loss read as a number. Same dimensions (TorchTitan's `debugmodel` on
CPU: dim 256, 6 layers, 16 heads, vocab 2048, batch 8 x 256; or one of kiln's presets with `--preset`), same
dtype, same process (so the same thread count), same compile setting; the parameter counts are checked equal.

Interleaved: B runs one step inside kiln's loop, from a hook after kiln's optimizer step, so the steps go
A B A B ... and a change in machine load hits both. Each side is timed as its loop sees it: a B step from
just before its data to just after its loss is read; an A step from the end of the previous B step to kiln's
next hook, which is one whole pass of kiln's loop (logging, status, data, forward/backward, clipping,
optimizer). Reported: both medians after warm-up, the ratio of medians and of the best steps, the median
of the per-pair ratios (each kiln step against the TorchTitan step right after it), the spread (min,
quartiles, max) and the machine's load average before and after.

TorchTitan is installed with `--no-deps` into `$KILN_CACHE_DIR/tools/torchtitan-<ver>` (its pins are not
kiln's) and put on sys.path by this script only; it is never a kiln dependency. Attention: 0.3.0 builds
its language models only with flex or varlen attention over block-causal (per-document) masks, which kiln
runs only for packed rows; its inner `ScaledDotProductAttention` module (causal SDPA, the attention kiln
runs on plain rows, the only one 0.2.2's debug model ran) is put in each block's config in their place, so
both sides run the same attention kernel and what differs is the rest of the model and the step.

    python -m tests.bench.bench_vs_torchtitan                                    # CPU, TorchTitan's debugmodel
    python -m tests.bench.bench_vs_torchtitan --device cuda --preset llama-1b    # one GPU, bf16
    python -m tests.bench.bench_vs_torchtitan --profile    # also each side's ops by self time, per step

(llama-8b: both models' fp32 weights, gradients and AdamW state take 240 GiB, more than one H200 holds.)
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.api import ModelDims, TrainingSpec, resolve_model
from kiln.trainer.observe.metrics import flops_per_token, peak_flops
from kiln.trainer.model.transformer import count_params
from tests.bench.report import write_report

# Per release, the model module's imports, transitively (torchtitan's package __init__ files reach its config
# and dataset code); none of them is torch, so kiln's torch serves.
TORCHTITAN_PACKAGES = {
    "0.3.0": ["torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17", "docstring_parser==0.18.0"],
    "0.2.2": ["torchtitan==0.2.2", "tyro==1.0.17", "docstring_parser==0.18.0", "torchdata==0.11.0",
              "datasets==5.2.0", "dill==0.4.1", "xxhash==4.1.0", "multiprocess==0.70.19", "pandas==3.1.1"],
}
# TorchTitan's llama3 "debugmodel" (its ffn: 2/3 * 4 * dim rounded up to 256 = 768; kv heads = heads).
DEBUGMODEL = dict(dim=256, layers=6, heads=16, kv_heads=16, vocab_size=2048, seq_len=256, ffn_dim=768,
                  rope_theta=500000.0)


def torchtitan_dir(version: str) -> Path:
    cache = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    return cache / "tools" / f"torchtitan-{version}"


def ensure_torchtitan(version: str) -> Path:
    """Install TorchTitan (no dependencies: kiln's torch is the one measured) once, and import from there."""
    target = torchtitan_dir(version)
    if not (target / "torchtitan").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        *TORCHTITAN_PACKAGES[version]], check=True)
    if str(target) not in sys.path:
        sys.path.append(str(target))  # appended: kiln's own packages (torch, numpy) stay first
    return target


def model_fields(args) -> dict:
    """kiln's model fields: the debug model's, or a preset's (with --seq-len)."""
    if args.preset == "debugmodel":
        return {**DEBUGMODEL, **({"seqLen": args.seq_len} if args.seq_len else {})}
    return {"preset": args.preset, **({"seqLen": args.seq_len} if args.seq_len else {})}


def make_spec(args) -> TrainingSpec:
    fields = model_fields(args)
    camel = {"kv_heads": "kvHeads", "vocab_size": "vocabSize", "seq_len": "seqLen", "ffn_dim": "ffnDim",
             "rope_theta": "ropeTheta"}
    return TrainingSpec.model_validate({
        "metadata": {"name": "bench-vs-torchtitan"},
        "spec": {
            "model": {camel.get(k, k): v for k, v in fields.items()},
            "data": {"uri": "synthetic"},
            "training": {"steps": args.warmup + args.steps + 1, "globalBatchSize": args.batch,
                         "microBatchSize": args.batch, "lr": 8e-4, "warmupSteps": 0, "schedule": "constant",
                         "gradClip": 1.0, "precision": args.precision},
            "parallelism": {"compile": not args.no_compile, "kernels": args.kernels},
            "checkpoint": {"intervalSteps": 10**9},
        },
    })


def llama3_v022(dims: ModelDims, compile_: bool) -> tuple[torch.nn.Module, object]:
    """0.2.2's Transformer, compiled per block (and its loss) by TorchTitan's own apply_compile. ffn: TorchTitan
    rounds 2/3 * 4 * dim up to `multiple_of`, so multiple_of = kiln's ffn_dim gives exactly that width."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=dims.dim, n_layers=dims.layers, n_heads=dims.heads, n_kv_heads=dims.kv_heads,
                                vocab_size=dims.vocab_size, multiple_of=dims.ffn_dim, norm_eps=dims.norm_eps,
                                rope_theta=dims.rope_theta, max_seq_len=dims.seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    if compile_:
        apply_compile(model, Compile(enable=True, components=["model", "loss"]))
    return model, (torch.compile(cross_entropy_loss) if compile_ else cross_entropy_loss)


def llama3_v030(dims: ModelDims, compile_: bool) -> tuple[torch.nn.Module, object]:
    """0.3.0's Llama3Model as its debugmodel builds it (fused QKV, complex RoPE, its inits) with kiln's dims and
    causal SDPA as the inner attention (the module docstring says why). Compiled by the step, as one graph."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)

    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=dims.layers, dim=dims.dim, n_heads=dims.heads, n_kv_heads=dims.kv_heads,
        hidden_dim=dims.ffn_dim, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dims.head_dim, max_seq_len=dims.seq_len, theta=dims.rope_theta, scaling="none"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    norm = RMSNorm.Config(normalized_shape=dims.dim, eps=dims.norm_eps, param_init=_NORM_INIT)
    config = Llama3Model.Config(
        dim=dims.dim, vocab_size=dims.vocab_size, norm=norm, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=dims.vocab_size, embedding_dim=dims.dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dims.dim, out_features=dims.vocab_size,
                              param_init=_output_linear_init(dims.dim)))
    for layer in layers:
        layer.attention_norm = layer.ffn_norm = norm
    with torch.device("meta"):
        model = config.build()
    return model, cross_entropy_loss


class TorchTitanStep:
    """TorchTitan's single-device training step (its trainer's train_step without the parallelisms)."""

    def __init__(self, dims: ModelDims, args, device: torch.device):
        from torchtitan.distributed.utils import clip_grad_norm_

        torch.manual_seed(0)
        build = llama3_v030 if args.torchtitan == "0.3.0" else llama3_v022
        model, loss_fn = build(dims, not args.no_compile)
        model.to_empty(device=device)
        with torch.no_grad():
            (model.init_states if hasattr(model, "init_states") else model.init_weights)(buffer_device=device)
        model.train()
        self.model, self.device, self.dims, self.batch = model, device, dims, args.batch
        self.forward_loss = self._forward_loss(model, loss_fn)
        if args.torchtitan == "0.3.0" and not args.no_compile:  # one graph: model and loss, as kiln at one rank
            self.forward_loss = torch.compile(self.forward_loss)
        self.clip = clip_grad_norm_
        # TorchTitan's optimizer defaults (lr 8e-4, eps 1e-8, weight decay 0.1, implementation "fused").
        self.opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                     fused=True)
        self.autocast = args.precision == "bf16"
        self.gen = torch.Generator().manual_seed(0)
        self.losses: list[float] = []
        self.fwd_bwd_s: list[float] = []  # each step's forward and backward, as kiln's metrics time its own

    @staticmethod
    def _forward_loss(model, loss_fn):
        def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return loss_fn(model(inputs), labels) / labels.numel()  # TorchTitan: sum over the global tokens
        return forward_loss

    def __call__(self) -> None:
        d = self.dims
        batch = torch.randint(0, d.vocab_size, (self.batch, d.seq_len + 1), generator=self.gen).to(self.device)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        start = _now(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.forward_loss(inputs, labels)
        loss.backward()
        self.fwd_bwd_s.append(_now(self.device) - start)
        self.clip(list(self.model.parameters()), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())


class Profile:
    """torch.profiler over the measured steps of both sides in the same run: each op's self time goes to the
    side whose step it ran in (TorchTitan's steps are marked with a record_function; everything else, from the
    end of one TorchTitan step to the start of the next, is kiln's loop). Per step, grouped by op name."""

    TITAN = "bench/torchtitan_step"

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities)
        self.on = False

    def toggle(self) -> None:
        if self.on:
            self.prof.stop()
        else:
            self.prof.start()
        self.on = not self.on

    def table(self, steps: int, top: int = 25) -> dict:
        """{side: {"total_self_s": per step, "ops": [[name, self seconds per step, calls per step], ...]}}."""
        events = self.prof.events()
        spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == self.TITAN)
        starts = [s for s, _ in spans]
        sides: dict[str, dict[str, list[float]]] = {"kiln": {}, "torchtitan": {}}
        for e in events:
            if e.name == self.TITAN:
                continue
            i = bisect.bisect_right(starts, e.time_range.start) - 1
            side = "torchtitan" if i >= 0 and e.time_range.start < spans[i][1] else "kiln"
            row = sides[side].setdefault(e.name, [0.0, 0])
            row[0] += e.self_cpu_time_total / 1e6 / steps
            row[1] += 1 / steps
        return {side: {"total_self_s": sum(t for t, _ in ops.values()),
                       "ops": [[name, t, round(n, 2)] for name, (t, n) in
                               sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]}
                for side, ops in sides.items()}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def spread(seconds: list[float], tokens: int) -> dict:
    """Median tokens/s and the spread of the step times, as tokens/s (min, quartiles, max)."""
    rates = sorted(tokens / s for s in seconds)
    q1, q2, q3 = statistics.quantiles(rates, n=4) if len(rates) > 1 else (rates[0],) * 3
    return {"tokens_per_second": statistics.median(rates), "best_step_tokens_per_second": rates[-1],
            "tokens_per_second_min_q1_q3_max": [rates[0], q1, q3, rates[-1]],
            "spread_max_over_min": rates[-1] / rates[0], "step_seconds_each": seconds}


def run_interleaved(args, device: torch.device, out_dir: Path) -> tuple[list[float], list[float], TorchTitanStep,
                                                                       list, dict | None]:
    """(kiln step seconds, TorchTitan step seconds, the TorchTitan side, kiln's losses, the profile with
    --profile), both after warm-up."""
    from kiln.trainer.guards.hooks import GuardHooks
    from kiln.trainer.loop import StepHooks, train

    spec = make_spec(args)
    dims = resolve_model(spec.spec.model)
    titan = TorchTitanStep(dims, args, device)
    kiln_s: list[float] = []
    titan_s: list[float] = []
    resume_at: list[float] = []  # when kiln's loop got control back from the last TorchTitan step

    profiler = Profile(device) if args.profile else None

    def interleave(ctx) -> None:
        end = _now(device)
        if resume_at:
            kiln_s.append(end - resume_at[-1])
        start = _now(device)
        with torch.profiler.record_function(Profile.TITAN):
            titan()
        titan_s.append(_now(device) - start)
        if profiler is not None and len(titan_s) in (args.warmup + 1, args.warmup + args.steps + 1):
            profiler.toggle()  # on after the last unmeasured step, off after the last measured one
        resume_at.append(_now(device))

    hooks = StepHooks()
    GuardHooks().install(hooks)  # what `kiln train` runs by default
    hooks.after_update.append(interleave)
    os.environ.setdefault("MASTER_PORT", "29537")
    if device.type == "cuda":
        os.environ.setdefault("LOCAL_RANK", "0")
    result = train(spec, output_dir=out_dir, hooks=hooks, checkpointing=False)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    kiln_fwd_bwd = [r["fwd_bwd_s"] for r in records if "fwd_bwd_s" in r]
    n_params = sum(p.numel() for p in titan.model.parameters())
    if n_params != count_params(dims):
        raise SystemExit(f"shapes differ: TorchTitan has {n_params} parameters, kiln {count_params(dims)}")
    # kiln's first timed step starts after the first TorchTitan step: the last `steps` of each (the loop ran
    # warmup + steps + 1, so both drop their first warmup + 1).
    profile = profiler.table(args.steps) if profiler is not None else None
    outside = loop_outside(kiln_s[-args.steps:], kiln_fwd_bwd[-args.steps:], titan_s[-args.steps:],
                           titan.fwd_bwd_s[-args.steps:])
    return kiln_s[-args.steps:], titan_s[-args.steps:], titan, result.losses, profile, outside


def loop_outside(kiln_s: list[float], kiln_fwd_bwd: list[float], titan_s: list[float],
                 titan_fwd_bwd: list[float]) -> dict:
    """Each side's step time outside forward/backward (data, clipping, AdamW on both; kiln's loop adds its
    guards, metrics, status and checkpoint check), medians per step. kiln's loop overhead: what it spends
    there beyond TorchTitan's step, as a share of its step."""
    kiln_out = statistics.median(s - f for s, f in zip(kiln_s, kiln_fwd_bwd))
    titan_out = statistics.median(s - f for s, f in zip(titan_s, titan_fwd_bwd))
    return {"kiln_s": kiln_out, "torchtitan_s": titan_out,
            "kiln_loop_overhead_fraction": (kiln_out - titan_out) / statistics.median(kiln_s)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="debugmodel", choices=["debugmodel", "llama-1b", "llama-8b"],
                   help="TorchTitan's debug model (CPU), or kiln's preset of that name (GPU)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 on cpu, 4 on cuda)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help="measured steps of each side")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured steps of each side first (compilation)")
    p.add_argument("--no-compile", action="store_true", help="both sides without torch.compile")
    p.add_argument("--torchtitan", default="0.3.0", choices=sorted(TORCHTITAN_PACKAGES),
                   help="0.3.0: fused QKV, one-graph compile (its best configuration); 0.2.2: per-block compile")
    p.add_argument("--kernels", default="fused", choices=["fused", "reference"], help="kiln's kernels switch")
    p.add_argument("--profile", action="store_true",
                   help="also torch.profiler over the measured steps: each side's top ops by self time, per step")
    p.add_argument("--out", default="runs/bench/vs_torchtitan.json")
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first steps compile)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    args.batch = args.batch or (4 if args.device == "cuda" else 8)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":  # both models live in this process, each with fp32 weights, grads and AdamW state
        need = 2 * 16 * count_params(resolve_model(make_spec(args).spec.model))
        if need > torch.cuda.get_device_properties(0).total_memory:
            p.error(f"--preset {args.preset}: the two models' weights, gradients and AdamW state alone take "
                    f"{need / 2**30:.0f} GiB, more than this GPU has")
    ensure_torchtitan(args.torchtitan)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        kiln_s, titan_s, titan, kiln_losses, profile, outside = run_interleaved(args, device, Path(tmp))
    load_after = os.getloadavg()

    dims = resolve_model(make_spec(args).spec.model)
    tokens = args.batch * dims.seq_len
    kiln, tt = spread(kiln_s, tokens), spread(titan_s, tokens)
    flops, peak = flops_per_token(dims), peak_flops(device, args.precision)  # peak None: no MFU (CPU)
    for side in (kiln, tt):
        side["mfu"] = side["tokens_per_second"] * flops / peak if peak else None
    result = {
        "bench": "vs_torchtitan", "torchtitan": args.torchtitan,
        "torchtitan_compile": ("one graph, model and loss" if args.torchtitan == "0.3.0" else "per block, and the loss"),
        "preset": args.preset, "dims": dims.model_dump(mode="json"),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "precision": args.precision, "batch": args.batch, "seq_len": dims.seq_len, "steps": args.steps,
        "warmup": args.warmup, "compile": not args.no_compile, "kernels": args.kernels,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "flops_per_token": flops, "peak_flops": peak,
        "timing": "interleaved A B A B in one process; each step as its own loop sees it",
        "load_average_1_5_15": {"before": list(load_before), "after": list(load_after)},
        "kiln": kiln, "torchtitan_llama3": tt,
        "ratio_of_medians": kiln["tokens_per_second"] / tt["tokens_per_second"],
        # The fastest step of each is the least disturbed by other load on a shared machine.
        "ratio_of_best_steps": kiln["best_step_tokens_per_second"] / tt["best_step_tokens_per_second"],
        # Each kiln step against the TorchTitan step right after it: load that drifts over the run moves both
        # steps of a pair alike, so the median of these ratios shakes less than the ratio of medians.
        "median_of_pair_ratios": statistics.median(t / k for k, t in zip(kiln_s, titan_s)),
        "outside_forward_backward_median_s": outside,
        "first_losses": {"kiln": kiln_losses[:3], "torchtitan": titan.losses[:3]},
    }
    if profile is not None:  # the profiler's own overhead slows both sides: such a run's ratios are not the figures
        result["profile_per_step"] = profile
    summary = {k: v for k, v in result.items() if k not in ("kiln", "torchtitan_llama3", "dims")}
    summary["kiln_tokens_per_second"] = kiln["tokens_per_second"]
    summary["torchtitan_tokens_per_second"] = tt["tokens_per_second"]
    summary["spread_max_over_min"] = {"kiln": kiln["spread_max_over_min"], "torchtitan": tt["spread_max_over_min"]}
    write_report(result, args.out, summary=summary)
    return result


if __name__ == "__main__":
    main()
