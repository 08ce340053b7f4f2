"""Linear + cross-entropy without the full logits tensor (Liger-style: the gradients are made in forward).

Tokens are processed in chunks. Per chunk: logits = h @ W.T (torch matmul), then one Triton program per
token computes the log-sum-exp with an online softmax, the token's loss, and overwrites its logits row
with d(loss)/d(logits); then d(hidden) = dlogits @ W and d(weight) += dlogits.T @ h. Only one chunk of
logits (about as large as the hidden states) is alive at a time. The backward just scales the saved
gradients by the incoming gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_VOCAB_BLOCK = 32768


@triton.jit
def _cross_entropy_kernel(LOGITS, stride_row, TARGETS, LOSS, N_VALID, n_cols, ignore_index, z_loss,
                          HAS_Z_LOSS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(ptr + cols, tl.zeros([BLOCK], dtype=LOGITS.dtype.element_ty), mask=cols < n_cols)
        return

    # Online softmax: running max m and running sum d of exp(x - m), one block of the vocabulary at a time.
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(d)
    # A target outside [0, vocab) gives a NaN loss (which the step guards catch) instead of reading past the
    # row; checking on the host would cost a device sync every step.
    in_range = (target >= 0) & (target < n_cols)
    loss = lse - tl.load(ptr + target, mask=in_range, other=float("nan")).to(tl.float32)
    grad_factor = 1.0
    if HAS_Z_LOSS:
        # z-loss = z * lse^2; its gradient is 2 * z * lse * softmax, folded into the softmax term.
        loss += z_loss * lse * lse
        grad_factor += 2.0 * z_loss * lse
    tl.store(LOSS + row, loss)

    if COMPUTE_GRAD:
        scale = 1.0 / tl.load(N_VALID)  # the mean over valid tokens
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) * grad_factor
            grad = tl.where(cols == target, grad - 1.0, grad) * scale
            tl.store(ptr + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def _chunk_rows(n_rows: int, vocab: int, hidden: int) -> int:
    # A chunk of logits about as large as the hidden states (the same rule Liger uses).
    return min(max(n_rows, 1), triton.next_power_of_2(triton.cdiv(n_rows, triton.cdiv(vocab, hidden))))


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"fused_linear_cross_entropy needs hidden (..., H), weight (V, H), targets (...), got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_linear_cross_entropy needs hidden and weight of one dtype, got {hidden.dtype} and {weight.dtype}")


def _forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float,
             compute_grad: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (mean loss, d loss/d hidden, d loss/d weight); the gradients are empty if not compute_grad."""
    _check(hidden, weight, targets)
    n_cols, vocab = hidden.shape[-1], weight.shape[0]
    h = hidden.reshape(-1, n_cols).contiguous()
    t = targets.reshape(-1).contiguous()
    weight = weight.contiguous()
    n_rows = h.shape[0]
    # A tensor, not a Python number: no host sync. All tokens ignored gives 0 / 1 = 0 and zero gradients.
    n_valid = (t != ignore_index).sum().clamp(min=1).to(torch.float32)
    losses = torch.empty(n_rows, dtype=torch.float32, device=h.device)
    if compute_grad:
        dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        dh2 = dh.view(-1, n_cols)
        dw = torch.zeros_like(weight)
    else:
        dh, dw = hidden.new_empty(0), weight.new_empty(0)
    chunk = chunk_size if chunk_size > 0 else _chunk_rows(n_rows, vocab, n_cols)
    block = min(_VOCAB_BLOCK, triton.next_power_of_2(vocab))
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        h_chunk = h[start:end]
        logits = h_chunk @ weight.t()
        _cross_entropy_kernel[(end - start,)](
            logits, logits.stride(0), t[start:end], losses[start:end], n_valid, vocab, ignore_index, z_loss,
            HAS_Z_LOSS=z_loss != 0.0, COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=32 if block >= 32768 else 16,
        )
        if compute_grad:  # logits now holds d(mean loss)/d(logits) for this chunk
            torch.mm(logits, weight, out=dh2[start:end])
            dw.addmm_(logits.t(), h_chunk)
    return losses.sum() / n_valid, dh, dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The eager path (a fraction of a custom op's per-call Python overhead)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, z_loss, compute_grad, chunk_size):
        loss, dh, dw = _forward(hidden, weight, targets, ignore_index, z_loss, compute_grad, chunk_size)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        return (*_scale(dloss, *ctx.saved_tensors), None, None, None, None, None)


def _scale(dloss: torch.Tensor, dh: torch.Tensor, dw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # In place, as Liger does: the saved gradients are used once (a second backward fails the version check).
    return dh.mul_(dloss), dw.mul_(dloss)


# The torch.compile path: a registered op that the compiler treats as an opaque call.
flce_fwd = torch.library.custom_op("kiln::fused_linear_cross_entropy_fwd", _forward, mutates_args=())


@flce_fwd.register_fake
def _(hidden, weight, targets, ignore_index, z_loss, compute_grad, chunk_size):
    _check(hidden, weight, targets)
    loss = hidden.new_empty((), dtype=torch.float32)
    if compute_grad:
        return loss, torch.empty_like(hidden), torch.empty_like(weight)
    return loss, hidden.new_empty(0), weight.new_empty(0)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _op_backward(ctx, dloss, _ddh, _ddw):
    return (*_scale(dloss, *ctx.saved_tensors), None, None, None, None, None)


flce_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against targets over non-ignored tokens (0 if all are ignored),
    plus z_loss * logsumexp^2 per valid token. chunk_size (tokens per chunk) defaults to logits ≈ hidden."""
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    args = (hidden, weight, targets, ignore_index, float(z_loss), compute_grad, chunk_size or 0)
    if torch.compiler.is_compiling():
        return flce_fwd(*args)[0]
    return _FusedLinearCrossEntropy.apply(*args)
