"""SwiGLU, silu(gate) * up, as one elementwise pass each way.

The backward recomputes sigmoid(gate) from the saved inputs instead of keeping silu(gate) alive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # silu'(g) = sig * (1 + g * (1 - sig))
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate.contiguous(), up.contiguous(), y, n, BLOCK=_BLOCK, num_warps=4)
    return y


def _backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            dy.contiguous(), gate.contiguous(), up.contiguous(), dgate, dup, n, BLOCK=_BLOCK, num_warps=4
        )
    return dgate, dup


class _SwiGLU(torch.autograd.Function):
    """The eager path (a fraction of a custom op's per-call Python overhead)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return _backward(dy, *ctx.saved_tensors)


# The torch.compile path: registered ops that the compiler treats as opaque calls.
swiglu_fwd = torch.library.custom_op("kiln::swiglu_fwd", _forward, mutates_args=())
swiglu_bwd = torch.library.custom_op("kiln::swiglu_bwd", _backward, mutates_args=())


@swiglu_fwd.register_fake
def _(gate, up):
    _check(gate, up)
    return torch.empty_like(gate)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, dy):
    return swiglu_bwd(dy, *ctx.saved_tensors)


swiglu_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and returned in the inputs' dtype."""
    if torch.compiler.is_compiling():
        return swiglu_fwd(gate, up)
    return _SwiGLU.apply(gate, up)
