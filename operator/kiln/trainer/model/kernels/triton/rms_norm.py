"""RMSNorm: one pass forward (saves only the per-row 1/rms), one pass backward for dx and dweight.

dweight is a reduction over all rows: each persistent program accumulates its rows' share in fp32
registers and writes one partial row; the partials are summed afterwards (no atomics, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.trainer.model.kernels.triton._common import program_count, row_settings


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * n_cols + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    row_offset = row_start.to(tl.int64) * n_cols  # int64: rows * cols may pass 2**31
    for row in range(row_start, row_end):
        offs = row_offset + cols
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        dyw = dy * w
        # d/dx of x * rstd(x): the rstd term couples the row through mean(dy * w * xhat).
        dx = (dyw - xhat * (tl.sum(dyw * xhat, axis=0) / n_cols)) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        row_offset += n_cols
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    block, num_warps = row_settings(n_cols)
    x2 = x.reshape(-1, n_cols).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _rms_norm_fwd_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, rstd, n_cols, eps, BLOCK=block, num_warps=num_warps)
    return y, rstd


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    block, num_warps = row_settings(n_cols)
    x2 = x.reshape(-1, n_cols).contiguous()
    n_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    programs = program_count(x.device, n_rows)
    partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            dy.reshape(-1, n_cols).contiguous(), x2, weight.contiguous(), rstd.contiguous(), dx, partial,
            n_rows, n_cols, triton.cdiv(n_rows, programs), BLOCK=block, num_warps=num_warps,
        )
    return dx, partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    """The eager path (a fraction of a custom op's per-call Python overhead)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_backward(dy, *ctx.saved_tensors), None)


# The torch.compile path: registered ops that the compiler treats as opaque calls.
rms_norm_fwd = torch.library.custom_op("kiln::rms_norm_fwd", _forward, mutates_args=())
rms_norm_bwd = torch.library.custom_op("kiln::rms_norm_bwd", _backward, mutates_args=())


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    return (*rms_norm_bwd(dy, *ctx.saved_tensors), None)


rms_norm_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension, statistics in fp32, returned in x's dtype."""
    if torch.compiler.is_compiling():
        return rms_norm_fwd(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)
