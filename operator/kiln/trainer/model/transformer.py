"""A Llama-style decoder, readable top to bottom (nanoGPT spirit, TorchTitan layout).

RMSNorm -> grouped-query attention with RoPE (through `F.scaled_dot_product_attention`) -> RMSNorm -> SwiGLU
MLP, repeated `layers` times, then a final RMSNorm and the output projection.

Parallelism is applied from outside (kiln.trainer.parallel.parallelize) to this plain module, so the code here knows
nothing about it, with two conventions that make that possible:
- the blocks live in an `nn.ModuleDict` keyed by layer index ("0", "1", ...), so a parameter's name is the
  same in every layout: a pipeline stage deletes the blocks it does not own and sets the embedding, final
  norm or output to None, and `layers.7.attention.wq.weight` still means the same tensor. Checkpoints
  reshard between layouts by these names.
- attention reshapes with `-1` heads, so a tensor-parallel rank that holds heads/tp of the heads works
  unchanged.

Build on the meta device (no memory), parallelize, then `to_empty(device=...)` and `init_weights(seed)`.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from kiln.api import ModelDims
from kiln.api.presets import RopeScaling
from kiln.trainer.model import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2): position p rotates pair i by p * theta^(-2i/head_dim)
    (with Llama 3.1's frequency scaling when `scaling` is given)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths slowed down by `factor`, short ones kept, a smooth blend
    between (Meta's reference, as transformers' `llama3` rope type computes it)."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Attention(nn.Module):
    """Causal grouped-query attention: kv_heads key/value heads shared by heads // kv_heads query heads each."""

    def __init__(self, dims: ModelDims):
        super().__init__()
        self.head_dim = dims.head_dim
        self.n_rep = dims.heads // dims.kv_heads
        self.wq = nn.Linear(dims.dim, dims.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dims.dim, dims.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dims.dim, dims.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dims.heads * self.head_dim, dims.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = kernels.apply_rope(q, k, cos[:seq], sin[:seq])
        # (bsz, heads, seq, head_dim) for SDPA; repeat each kv head for its group of query heads.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_rep > 1:  # a copy of k and v, even for n_rep 1
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(kernels.swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.attention_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.attention = Attention(dims)
        self.ffn_norm = RMSNorm(dims.dim, dims.norm_eps)
        self.feed_forward = FeedForward(dims.dim, dims.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab), or the mean loss when targets are given."""

    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(dims.vocab_size, dims.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dims) for i in range(dims.layers)})
        self.norm: RMSNorm | None = RMSNorm(dims.dim, dims.norm_eps)
        self.output: nn.Linear | None = nn.Linear(dims.dim, dims.vocab_size, bias=False)
        # Derived, never checkpointed: recomputed by init_weights on the real device.
        cos, sin = rope_tables(dims.head_dim, dims.seq_len, dims.rope_theta, scaling=dims.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The fused linear+cross-entropy needs the whole output weight and the last hidden state in one
        # place; under tensor or pipeline parallelism the loss is taken from the logits instead.
        self.fused_loss = True

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # Pipeline stages: the first stage embeds tokens, later ones receive hidden states.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.norm is None:
            return h
        return self.head(h, targets)

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, then the logits, or the loss when targets are given (kiln.trainer.parallel.parallelize compiles it
        when the reference kernels run)."""
        h = self.norm(h)
        if targets is not None and self.fused_loss:
            return kernels.fused_linear_cross_entropy(h, self.output.weight, targets)
        logits = self.output(h)
        return logits if targets is None else cross_entropy(logits, targets)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The derived, non-checkpointed buffers (RoPE tables) on the real device; weights are left as they are
        (for a model whose weights are loaded instead, kiln.trainer.model.hf_folder)."""
        d = self.dims
        cos, sin = rope_tables(d.head_dim, d.seq_len, d.rope_theta, device=self.rope_cos.device, scaling=d.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from (seed, its name): the same values in every parallel layout.

        Each rank computes the full tensor from a generator seeded by the parameter's name and keeps its
        own shard, so a model split by FSDP, TP or PP starts exactly where the single-process model does.
        """
        self.init_buffers()
        device = self.rope_cos.device
        # Residual-branch outputs are scaled down so the residual stream's variance stays O(1) with depth.
        out_std = 0.02 / math.sqrt(2 * self.dims.layers)
        for name, param in self.named_parameters():
            full = torch.empty(param.shape, dtype=torch.float32, device=device)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full.normal_(0.0, std, generator=gen)
            _copy_into(param, full)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter that may be a DTensor shard (FSDP, TP)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the same full tensor, so no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the positions whose target is not ignored (-100, kiln.trainer.model.loss.IGNORE), in
    fp32; 0 when all are (a chat microbatch without assistant tokens), as the fused kernels give."""
    flat = targets.flatten()
    total = F.cross_entropy(logits.flatten(0, 1).float(), flat, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


def build_model(dims: ModelDims) -> Transformer:
    """The model on the meta device: shapes only, no memory; parallelize, then to_empty + init_weights."""
    with torch.device("meta"):
        return Transformer(dims)


def count_params(dims: ModelDims, *, embedding: bool = True) -> int:
    """Parameters of the full model from its dims (the input embedding is a lookup, not a matmul)."""
    hd = dims.head_dim
    attn = dims.dim * hd * (2 * dims.heads + 2 * dims.kv_heads)
    ffn = 3 * dims.dim * dims.ffn_dim
    per_layer = attn + ffn + 2 * dims.dim
    total = dims.layers * per_layer + dims.dim + dims.vocab_size * dims.dim
    return total + (dims.vocab_size * dims.dim if embedding else 0)
