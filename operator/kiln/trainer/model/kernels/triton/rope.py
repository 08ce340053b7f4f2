"""Rotary embedding (rotate-half convention) for q and k in one launch, one program per token.

The backward is the same rotation by the opposite angle (the rotation matrix is orthogonal), so it reuses
the forward kernel with the sine negated; nothing but cos and sin is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, Y, row, n_heads, cos, sin, half, H_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    heads = tl.arange(0, H_BLOCK)[:, None]
    dims = tl.arange(0, D_BLOCK)[None, :]
    mask = (heads < n_heads) & (dims < half)
    offs = row * n_heads * 2 * half + heads * 2 * half + dims
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + half, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, Q_OUT, K_OUT, COS, SIN, seq_len, n_q_heads, n_k_heads, half,
                 QH_BLOCK: tl.constexpr, KH_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, INVERSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # index over the flattened (leading..., seq) dimensions
    pos = row % seq_len
    dims = tl.arange(0, D_BLOCK)[None, :]
    cos = tl.load(COS + pos * half + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * half + dims, mask=dims < half, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    _rotate(Q, Q_OUT, row, n_q_heads, cos, sin, half, QH_BLOCK, D_BLOCK)
    _rotate(K, K_OUT, row, n_k_heads, cos, sin, half, KH_BLOCK, D_BLOCK)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool):
    if q.dim() < 3 or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1] or q.shape[-1] % 2:
        raise ValueError(f"apply_rope needs q (..., seq, heads, head_dim) and k (..., seq, kv_heads, head_dim) "
                         f"with one even head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    seq_len, half = q.shape[-3], q.shape[-1] // 2
    if tuple(cos.shape) != (seq_len, half) or tuple(sin.shape) != (seq_len, half):
        raise ValueError(f"apply_rope needs cos and sin of shape (seq, head_dim // 2) = {(seq_len, half)}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rows = q.numel() // (q.shape[-2] * q.shape[-1])
    if rows:
        d_block = triton.next_power_of_2(half)
        qh_block, kh_block = triton.next_power_of_2(q.shape[-2]), triton.next_power_of_2(k.shape[-2])
        num_warps = 8 if max(qh_block, kh_block) * d_block >= 4096 else 4
        _rope_kernel[(rows,)](
            q, k, q_out, k_out, cos.contiguous(), sin.contiguous(), seq_len, q.shape[-2], k.shape[-2], half,
            QH_BLOCK=qh_block, KH_BLOCK=kh_block, D_BLOCK=d_block, INVERSE=inverse, num_warps=num_warps,
        )
    return q_out, k_out


def _forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, inverse=False)


def _backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(dq, dk, cos, sin, inverse=True)


class _Rope(torch.autograd.Function):
    """The eager path (a fraction of a custom op's per-call Python overhead)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        return (*_backward(dq, dk, *ctx.saved_tensors), None, None)


# The torch.compile path: registered ops that the compiler treats as opaque calls.
rope_fwd = torch.library.custom_op("kiln::rope_fwd", _forward, mutates_args=())
rope_bwd = torch.library.custom_op("kiln::rope_bwd", _backward, mutates_args=())


def _fake(a, b, cos, sin):
    return torch.empty_like(a, memory_format=torch.contiguous_format), torch.empty_like(b, memory_format=torch.contiguous_format)


rope_fwd.register_fake(_fake)
rope_bwd.register_fake(_fake)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _op_backward(ctx, dq, dk):
    return (*rope_bwd(dq, dk, *ctx.saved_tensors), None, None)


rope_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (..., seq, heads, head_dim) and k (..., seq, kv_heads, head_dim) by cos/sin (seq, head_dim // 2)."""
    if torch.compiler.is_compiling():
        return rope_fwd(q, k, cos, sin)
    return _Rope.apply(q, k, cos, sin)
