"""Plain PyTorch reference implementations of the fused ops: the definition of correct.

They work on any device and on DTensors (tensor parallel), and are what `torch.compile` fuses off-GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half convention.

    q: (..., seq, heads, head_dim), k: (..., seq, kv_heads, head_dim); cos/sin: (seq, head_dim // 2).
    """

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c = cos.float()[:, None, :]
        s = sin.float()[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against targets, over non-ignored tokens (0 if all ignored)."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    flat_targets = targets.reshape(-1)
    losses = F.cross_entropy(logits, flat_targets, ignore_index=ignore_index, reduction="none")
    if z_loss:
        losses = losses + z_loss * torch.logsumexp(logits, dim=-1).pow(2)
    valid = (flat_targets != ignore_index).float()
    return (losses * valid).sum() / valid.sum().clamp(min=1.0)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: Gemma's gated MLP (transformers' gelu_pytorch_tanh)."""
    return F.gelu(gate, approximate="tanh") * up
