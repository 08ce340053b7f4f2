"""Fused kernels on one GPU: time, achieved bandwidth and memory against eager PyTorch, torch.compile and Liger.

For each op, forward and forward+backward are timed (`triton.testing.do_bench`, median) for
  eager     the plain PyTorch reference (kiln.trainer.model.kernels.reference)
  compiled  torch.compile of that reference
  kiln      the Triton kernels (kiln.trainer.model.kernels.triton)
  liger     Liger-Kernel's op where it has the same one (skipped with the reason if it does not import)
at Llama-3-8B sizes in bf16. Memory-bound ops report the bandwidth they achieve on the bytes they must move
(each input read once, each output written once) as a fraction of the device's measured copy bandwidth.
Fused linear cross-entropy reports TFLOP/s (three matmuls) and its peak memory against the unfused reference
at vocabulary 128k. Writes JSON to --out. Needs CUDA; elsewhere it says so and exits.

    python -m tests.bench.bench_kernels [--out runs/bench/kernels.json] [--no-compile] [--no-liger]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from tests.bench.report import write_report

REPO = Path(__file__).resolve().parents[2]


def _liger() -> tuple[dict[str, Callable] | None, str]:
    """Liger's ops with kiln's call shapes, or None and why not."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # not installed, or built for another torch/triton
        return None, f"liger-kernel unavailable: {type(e).__name__}: {e}"
    import importlib.metadata

    def flce(h, w, t):
        out = LigerFusedLinearCrossEntropyFunction.apply(h.reshape(-1, h.shape[-1]), w, t.reshape(-1), None, None, -100)
        return out[0] if isinstance(out, tuple) else out

    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5),
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        # Liger's rope takes Hugging Face's layout: q (batch, heads, seq, dim), cos/sin (1, seq, dim).
        "apply_rope": lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin, None, 1),
        "fused_linear_cross_entropy": flce,
    }, importlib.metadata.version("liger-kernel")


def _copy_bandwidth(do_bench, device: str, size: int) -> float:
    """Bytes per second of a device-to-device copy of `size` bytes (read + write)."""
    x = torch.empty(size, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def _timed(do_bench, fn: Callable, leaves: list[torch.Tensor], grads, backward: bool) -> float:
    def step():
        out = fn(*leaves)
        if backward:
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, grads)

    return do_bench(step, grad_to_none=leaves if backward else None)


def _peak_gib(fn: Callable, leaves: list[torch.Tensor]) -> float | None:
    """Peak memory above what was allocated before one forward+backward (gradients included)."""
    if not leaves[0].is_cuda:
        return None
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*leaves).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    return peak / 2**30


def run(args: argparse.Namespace, dev: str = "cuda", do_bench: Callable | None = None,
        progress: Callable[[dict], None] | None = None) -> dict:
    """The measurements; `dev` and `do_bench` are parameters only so that the script's paths can be exercised
    without a GPU (under the Triton interpreter, with a wall-clock timer). `progress` gets the results so far
    after each op (main writes them, so a run stopped at a time limit keeps the ops it finished)."""
    import triton

    from kiln.trainer.model.kernels import reference
    from kiln.trainer.model.kernels import triton as kiln_ops

    if do_bench is None:
        from triton.testing import do_bench as triton_do_bench

        def do_bench(fn, grad_to_none=None):
            return triton_do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, grad_to_none=grad_to_none, return_mode="median")

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    copy_bw = _copy_bandwidth(do_bench, dev, 2**30 if dev == "cuda" else 2**20)
    liger, liger_version = (None, "disabled by --no-liger") if args.no_liger else _liger()

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=bf16) * scale).requires_grad_()

    m, n, ffn = args.tokens, args.hidden, args.ffn
    b, s, hq, hk, d = args.batch, args.tokens // args.batch, args.heads, args.kv_heads, args.head_dim
    angles = torch.outer(torch.arange(s, device=dev).float(), 1.0 / (500000 ** (torch.arange(0, d, 2, device=dev).float() / d)))
    cos, sin = angles.cos(), angles.sin()
    hf_cos, hf_sin = torch.cat((cos, cos), -1)[None].to(bf16), torch.cat((sin, sin), -1)[None].to(bf16)
    es = 2  # bytes per bf16 element

    # op -> (kiln/reference inputs, liger inputs, output grads, bytes forward, bytes backward, flops)
    specs = {
        "rms_norm": dict(
            make=lambda: [leaf(m, n), (torch.rand(n, device=dev, dtype=bf16) + 0.5).requires_grad_()],
            liger_args=lambda x, w: [x, w], extra=(1e-5,), liger_extra=(),
            grads=lambda: (torch.randn(m, n, device=dev, dtype=bf16),),
            bytes_fwd=2 * m * n * es, bytes_bwd=3 * m * n * es),
        "swiglu": dict(
            make=lambda: [leaf(m, ffn), leaf(m, ffn)], liger_args=lambda g, u: [g, u], extra=(), liger_extra=(),
            grads=lambda: (torch.randn(m, ffn, device=dev, dtype=bf16),),
            bytes_fwd=3 * m * ffn * es, bytes_bwd=5 * m * ffn * es),
        "apply_rope": dict(
            make=lambda: [leaf(b, s, hq, d), leaf(b, s, hk, d)],
            liger_args=lambda q, k: [q.detach().transpose(1, 2).contiguous().requires_grad_(),
                                     k.detach().transpose(1, 2).contiguous().requires_grad_()],
            extra=(cos, sin), liger_extra=(hf_cos, hf_sin),
            grads=lambda: (torch.randn(b, s, hq, d, device=dev, dtype=bf16), torch.randn(b, s, hk, d, device=dev, dtype=bf16)),
            liger_grads=lambda: (torch.randn(b, hq, s, d, device=dev, dtype=bf16), torch.randn(b, hk, s, d, device=dev, dtype=bf16)),
            bytes_fwd=2 * b * s * (hq + hk) * d * es, bytes_bwd=2 * b * s * (hq + hk) * d * es),
    }

    results: dict = {"copy_bandwidth_gbps": copy_bw / 1e9, "ops": {}}
    for op, spec in specs.items():
        leaves = spec["make"]()
        grads = spec["grads"]()
        impls: dict[str, tuple[Callable, list, tuple]] = {
            "eager": (lambda *a, f=getattr(reference, op), e=spec["extra"]: f(*a, *e), leaves, grads),
            "kiln": (lambda *a, f=getattr(kiln_ops, op), e=spec["extra"]: f(*a, *e), leaves, grads),
        }
        if not args.no_compile:
            compiled = torch.compile(getattr(reference, op))
            impls["compiled"] = (lambda *a, f=compiled, e=spec["extra"]: f(*a, *e), leaves, grads)
        if liger is not None:
            impls["liger"] = (lambda *a, f=liger[op], e=spec["liger_extra"]: f(*a, *e), spec["liger_args"](*leaves),
                              spec.get("liger_grads", spec["grads"])())
        row: dict = {}
        for name, (fn, impl_leaves, impl_grads) in impls.items():
            try:
                fwd = _timed(do_bench, fn, impl_leaves, impl_grads, backward=False)
                both = _timed(do_bench, fn, impl_leaves, impl_grads, backward=True)
            except Exception as e:  # one failing comparison (say, a Liger version mismatch) must not lose the rest
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            row[name] = {
                "fwd_ms": fwd, "fwd_bwd_ms": both,
                "fwd_frac_copy_bw": spec["bytes_fwd"] / (fwd * 1e-3) / copy_bw,
                "fwd_bwd_frac_copy_bw": (spec["bytes_fwd"] + spec["bytes_bwd"]) / (both * 1e-3) / copy_bw,
            }
        _ratios(row)
        results["ops"][op] = row
        print(_line(op, row), flush=True)
        if progress is not None:
            progress(results)

    # The LM head and its loss: compute-bound (three matmuls), and memory is the point of fusing it.
    t, v = args.flce_tokens, args.vocab
    h = leaf(t, n)
    w = leaf(v, n, scale=n**-0.5)
    targets = torch.randint(0, v, (t,), device=dev)
    targets[:: 7] = -100
    flce_impls = {"eager": lambda h, w: reference.fused_linear_cross_entropy(h, w, targets),
                  "kiln": lambda h, w: kiln_ops.fused_linear_cross_entropy(h, w, targets)}
    if not args.no_compile:
        compiled_flce = torch.compile(reference.fused_linear_cross_entropy)
        flce_impls["compiled"] = lambda h, w: compiled_flce(h, w, targets)
    if liger is not None:
        flce_impls["liger"] = lambda h, w, f=liger["fused_linear_cross_entropy"]: f(h, w, targets)
    flops = 6 * t * n * v
    row = {}
    for name, fn in flce_impls.items():
        try:
            both = _timed(do_bench, fn, [h, w], None, backward=True)
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        row[name] = {"fwd_bwd_ms": both, "tflops": flops / (both * 1e-3) / 1e12, "peak_gib": _peak_gib(fn, [h, w])}
    _ratios(row)
    results["ops"]["fused_linear_cross_entropy"] = {"tokens": t, "hidden": n, "vocab": v, **row}
    print(_line("fused_linear_cross_entropy", row), flush=True)
    results["liger"] = liger_version
    results["triton"] = triton.__version__
    return results


def _ratios(row: dict) -> None:
    if "error" in row["kiln"]:
        return
    kiln = row["kiln"]["fwd_bwd_ms"]
    for name, r in row.items():
        if name != "kiln" and "error" not in r:
            r["kiln_speedup"] = r["fwd_bwd_ms"] / kiln  # > 1: kiln is faster than this implementation


def _line(op: str, row: dict) -> str:
    parts = []
    for name, r in row.items():
        if "error" in r:
            parts.append(f"{name} failed ({r['error'][:80]})")
            continue
        if "fwd_bwd_frac_copy_bw" in r:
            extra = f" {r['fwd_bwd_frac_copy_bw']:.0%}bw"
        else:
            extra = f" {r['tflops']:.0f}TFLOP/s" + (f" peak {r['peak_gib']:.1f}GiB" if r["peak_gib"] is not None else "")
        parts.append(f"{name} {r['fwd_bwd_ms']:.3f}ms{extra}")
    return f"{op:28s} fwd+bwd: " + " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "runs" / "bench" / "kernels.json"))
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq for rms_norm, swiglu, rope")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--flce-tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference (saves compile time)")
    p.add_argument("--no-liger", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU here; the kernels are benchmarked on a GPU (tests/bench/gpu_kernels.sh). "
              "Their correctness on CPU is tests/unit/test_kernels.py (Triton interpreter).", file=sys.stderr)
        return 0
    started = time.time()
    about = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                 args=vars(args))

    def partial(results: dict) -> None:
        write_report({**results, **about, "complete": False}, args.out, summary={"wrote": args.out, "partial": True})

    results = run(args, progress=partial)
    results.update(about, complete=True, wall_s=time.time() - started)
    write_report(results, args.out, summary={"wrote": args.out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
