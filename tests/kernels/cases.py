"""Correctness cases for kiln.trainer.model.kernels.triton against the fp32 reference, forward and backward.

Each case builds inputs, runs the Triton op and the reference on fp32 copies of the same inputs, and asserts
that outputs and gradients agree within the tolerance of the dtype. The module imports Triton lazily:
`tests/unit/test_kernels.py` runs these functions in a worker process started with TRITON_INTERPRET=1
(which must be set before triton is first imported); on a GPU they run as they are.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kiln.trainer.model.kernels import reference

# (rtol, atol) per dtype of the inputs. fp32: the kernels compute in fp32 like the reference, so only
# summation order differs. bf16: the inputs are the same bf16 values, outputs and gradients are rounded
# to bf16 once (2**-8 relative) and the LM head's logits are bf16 matmul outputs, hence the looser bound.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
# Fused linear cross-entropy sums over many tokens and the vocabulary in a different order than the
# reference (chunked matmuls, bf16 d(logits)), so its gradients get a bound relative to their scale.
FLCE_TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _ops():
    from kiln.trainer.model.kernels import triton as triton_ops

    return triton_ops


def _leaf(t: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).requires_grad_()


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().requires_grad_()


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], scale: float = 1.0) -> None:
    rtol, atol = tol
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{name}: {m}")


def rms_norm_case(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = _leaf(torch.randn(shape, generator=g) * 3 + 0.5, dtype, device)
    w = _leaf(torch.rand(shape[-1], generator=g) + 0.5, dtype, device)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    y = _ops().rms_norm(x, w, 1e-5)
    y.backward(dy)
    xr, wr = _fp32_copy(x), _fp32_copy(w)
    yr = reference.rms_norm(xr, wr, 1e-5)
    yr.backward(dy.float())
    tol = TOLERANCES[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    _close("y", y, yr, tol)
    _close("dx", x.grad, xr.grad, tol)
    # dweight sums over all rows: scale the absolute bound by the number of rows it adds up.
    _close("dweight", w.grad, wr.grad, tol, scale=max(1.0, (x.numel() // shape[-1]) ** 0.5))


def swiglu_case(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    gate = _leaf(torch.randn(shape, generator=g) * 4, dtype, device)
    up = _leaf(torch.randn(shape, generator=g), dtype, device)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    y = _ops().swiglu(gate, up)
    y.backward(dy)
    gr, ur = _fp32_copy(gate), _fp32_copy(up)
    reference.swiglu(gr, ur).backward(dy.float())
    tol = TOLERANCES[dtype]
    _close("y", y, reference.swiglu(gr.detach(), ur.detach()), tol)
    _close("dgate", gate.grad, gr.grad, tol)
    _close("dup", up.grad, ur.grad, tol)


def rope_case(q_shape: tuple[int, ...], kv_heads: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    *lead, seq, _heads, head_dim = q_shape
    k_shape = (*lead, seq, kv_heads, head_dim)
    q = _leaf(torch.randn(q_shape, generator=g), dtype, device)
    k = _leaf(torch.randn(k_shape, generator=g), dtype, device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    dq = torch.randn(q_shape, generator=g).to(device=device, dtype=dtype)
    dk = torch.randn(k_shape, generator=g).to(device=device, dtype=dtype)
    qo, ko = _ops().apply_rope(q, k, cos, sin)
    torch.autograd.backward((qo, ko), (dq, dk))
    qr, kr = _fp32_copy(q), _fp32_copy(k)
    qro, kro = reference.apply_rope(qr, kr, cos, sin)
    torch.autograd.backward((qro, kro), (dq.float(), dk.float()))
    tol = TOLERANCES[dtype]
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    _close("q", qo, qro, tol)
    _close("k", ko, kro, tol)
    _close("dq", q.grad, qr.grad, tol)
    _close("dk", k.grad, kr.grad, tol)


def flce_case(lead: tuple[int, ...], hidden: int, vocab: int, dtype: torch.dtype, device: str = "cpu", *,
              ignored: float = 0.0, z_loss: float = 0.0, ignore_index: int = -100, chunk_size: int | None = None,
              grad_scale: float = 1.0, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    h = _leaf(torch.randn((*lead, hidden), generator=g), dtype, device)
    w = _leaf(torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 2, dtype, device)
    targets = torch.randint(0, vocab, lead, generator=g)
    targets[torch.rand(lead, generator=g) < ignored] = ignore_index
    targets = targets.to(device)
    loss = _ops().fused_linear_cross_entropy(h, w, targets, ignore_index, z_loss, chunk_size=chunk_size)
    (loss * grad_scale).backward()
    hr, wr = _fp32_copy(h), _fp32_copy(w)
    loss_ref = reference.fused_linear_cross_entropy(hr, wr, targets, ignore_index, z_loss)
    (loss_ref * grad_scale).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    rtol, atol = FLCE_TOLERANCES[dtype]
    _close("loss", loss, loss_ref, (rtol, atol), scale=max(1.0, float(loss_ref.detach().abs())))
    # Gradients are O(1 / tokens): the absolute bound is relative to the largest reference gradient.
    _close("dhidden", h.grad, hr.grad, (rtol, atol), scale=float(hr.grad.abs().max().clamp(min=1e-30)))
    _close("dweight", w.grad, wr.grad, (rtol, atol), scale=float(wr.grad.abs().max().clamp(min=1e-30)))


def flce_all_ignored_case(dtype: torch.dtype, device: str = "cpu") -> None:
    """A batch with no target at all: loss 0 and exactly zero gradients, not NaN."""
    h = _leaf(torch.randn(3, 5, 32), dtype, device)
    w = _leaf(torch.randn(300, 32), dtype, device)
    targets = torch.full((3, 5), -100, device=device)
    loss = _ops().fused_linear_cross_entropy(h, w, targets)
    loss.backward()
    assert float(loss) == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0
    assert bool(torch.isfinite(h.grad).all()) and bool(torch.isfinite(w.grad).all())


def flce_bad_target_case(device: str = "cpu") -> None:
    """A target outside the vocabulary makes the loss NaN (visible to the step guards), never a wrong number."""
    h = torch.randn(4, 16, device=device)
    w = torch.randn(50, 16, device=device)
    for bad in (50, -3):
        targets = torch.tensor([1, bad, 2, -100], device=device)
        assert torch.isnan(_ops().fused_linear_cross_entropy(h, w, targets)), f"target {bad} was not flagged"


def flce_no_grad_case(device: str = "cpu") -> None:
    """Evaluation (no_grad): the same loss, no gradient work kept alive."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, 48, generator=g).to(device)
    w = torch.randn(700, 48, generator=g).to(device) / 7
    targets = torch.randint(0, 700, (2, 9), generator=g).to(device)
    with torch.no_grad():
        loss = _ops().fused_linear_cross_entropy(h, w, targets)
    _close("loss", loss, reference.fused_linear_cross_entropy(h, w, targets), TOLERANCES[torch.float32])
    assert not loss.requires_grad


def compile_case(device: str = "cpu") -> None:
    """torch.compile(fullgraph=True) traces around the custom ops: same values and gradients as eager."""
    ops = _ops()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 4, 16, generator=g).to(device)
    norm_w = (torch.rand(16, generator=g) + 0.5).to(device)
    head = (torch.randn(50, 32, generator=g) / 4).to(device)
    angles = torch.randn(6, 8, generator=g)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    targets = torch.randint(0, 50, (2, 6), generator=g).to(device)

    def step(x, norm_w, head):
        h = ops.rms_norm(x, norm_w, 1e-5)
        q, k = ops.apply_rope(h, h * 2, cos, sin)
        a = ops.swiglu(q, k).reshape(2, 6, 64)[..., :32]
        return ops.fused_linear_cross_entropy(a, head, targets)

    graphs: list[str] = []

    def backend(gm, example_inputs):  # record what dynamo captured, then compile it as aot_eager does
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        leaves = [t.clone().requires_grad_() for t in (x, norm_w, head)]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss, *(t.grad for t in leaves)])
    for name, eager, compiled in zip(("loss", "dx", "dnorm", "dhead"), *results):
        _close(name, compiled, eager, TOLERANCES[torch.float32])
    for op in ("rms_norm_fwd", "rope_fwd", "swiglu_fwd", "fused_linear_cross_entropy_fwd"):
        assert f"kiln.{op}" in graphs[0], f"the compiled graph does not call torch.ops.kiln.{op}"


def switch_case(device: str = "cpu") -> None:
    """The public switch: the reference mode is exactly the reference; bad modes are a KilnError."""
    from kiln import errors
    from kiln.trainer.model import kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 40, generator=g).to(device)
    w = torch.rand(40, generator=g).to(device)
    try:
        kernels.set_mode("reference")
        assert kernels.get_mode() == "reference"
        assert torch.equal(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
        assert torch.equal(kernels.swiglu(x, x * 2), reference.swiglu(x, x * 2))
        try:
            kernels.set_mode("triton")
        except errors.KilnError as e:
            assert "fused" in str(e) and "'triton'" in str(e)
        else:
            raise AssertionError("set_mode('triton') was accepted")
        kernels.set_mode("fused")
        y = kernels.rms_norm(x, w, 1e-5)
        _close("fused-mode rms_norm", y, reference.rms_norm(x, w, 1e-5), TOLERANCES[torch.float32])
        # Fused mode runs Triton exactly on plain CUDA tensors and the reference exactly elsewhere.
        expected = _ops().rms_norm(x, w, 1e-5) if x.is_cuda else reference.rms_norm(x, w, 1e-5)
        assert torch.equal(y, expected), "fused mode picked the wrong implementation"
    finally:
        kernels.set_mode("fused")


def dtensor_case() -> None:
    """DTensors (tensor parallel) go through the switch to the reference and stay DTensors."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from kiln.trainer.model import kernels

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            x = torch.randn(4, 6, 32)
            w = torch.rand(32) + 0.5
            dx = distribute_tensor(x, mesh, [Shard(0)])
            dw = distribute_tensor(w, mesh, [Replicate()])
            y = kernels.rms_norm(dx, dw, 1e-5)
            assert isinstance(y, DTensor)
            _close("rms_norm(DTensor)", y.full_tensor(), reference.rms_norm(x, w, 1e-5), TOLERANCES[torch.float32])
            s = kernels.swiglu(dx, dx)
            assert isinstance(s, DTensor)
            _close("swiglu(DTensor)", s.full_tensor(), reference.swiglu(x, x), TOLERANCES[torch.float32])
        finally:
            dist.destroy_process_group()


def interpreter_active() -> bool:
    """True when the Triton kernels in this process run under the interpreter."""
    import importlib

    from triton import knobs

    rms_norm_module = importlib.import_module("kiln.trainer.model.kernels.triton.rms_norm")
    return bool(knobs.runtime.interpret) and type(rms_norm_module._rms_norm_fwd_kernel).__name__ == "InterpretedFunction"


def gpu_cases(device: str) -> list[tuple[str, object]]:
    """The cases at sizes a GPU runs in seconds (the interpreter runs a smaller set, see test_kernels.py)."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases: list[tuple[str, object]] = []
    for dtype in (f32, bf16):
        for shape in ((1, 4097), (8, 512, 4096), (3, 77, 5120)):
            cases.append((f"rms_norm{shape}-{dtype}", lambda s=shape, d=dtype: rms_norm_case(s, d, device)))
            cases.append((f"swiglu{shape}-{dtype}", lambda s=shape, d=dtype: swiglu_case(s, d, device)))
        for q_shape, kv in (((4, 512, 32, 128), 8), ((1, 7, 3, 6), 1)):
            cases.append((f"rope{q_shape}-{dtype}", lambda s=q_shape, kv=kv, d=dtype: rope_case(s, kv, d, device)))
        for lead, hid, voc, kw in (((4, 512), 1024, 50257, {"ignored": 0.2}), ((1,), 4097, 32000, {}),
                                   ((2, 256), 512, 131072, {"z_loss": 1e-4, "ignored": 0.5})):
            cases.append((f"flce{lead}x{hid}x{voc}-{dtype}", lambda l=lead, h=hid, v=voc, kw=kw, d=dtype: flce_case(l, h, v, d, device, **kw)))
        cases.append((f"flce-all-ignored-{dtype}", lambda d=dtype: flce_all_ignored_case(d, device)))
    cases.append(("flce-no-grad", lambda: flce_no_grad_case(device)))
    cases.append(("flce-bad-target", lambda: flce_bad_target_case(device)))
    cases.append(("compile", lambda: compile_case(device)))
    cases.append(("switch", lambda: switch_case(device)))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the kernel correctness cases on a device (a GPU).")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="also write each case's outcome as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run tests/unit/test_kernels.py for the interpreter cases instead", file=sys.stderr)
        return 2
    outcomes: dict[str, str] = {}
    for name, case in gpu_cases(args.device):
        status, detail = "ok", ""
        try:
            case()
        except AssertionError as e:
            status, detail = "FAIL", str(e)
        except Exception as e:  # a kernel that does not compile or launch: the other cases still run
            status, detail = "ERROR", f"{type(e).__name__}: {e}"
        outcomes[name] = f"{status}: {detail}" if detail else status
        print(f"{status:5s} {name}" + (f": {detail}" if detail else ""), flush=True)
    failed = [name for name, outcome in outcomes.items() if outcome != "ok"]
    print(f"{len(failed)} failed" if failed else "all kernel cases passed")
    if args.out:
        from tests.bench.report import write_report

        device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        write_report({"check": "kernel_cases", "device": device, "torch": torch.__version__, "cases": len(outcomes),
                      "failed": failed, "outcomes": outcomes}, args.out,
                     summary={"wrote": args.out, "cases": len(outcomes), "failed": len(failed)})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
