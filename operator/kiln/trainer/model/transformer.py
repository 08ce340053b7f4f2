"""A Llama-style decoder, readable top to bottom (nanoGPT spirit, TorchTitan layout).

RMSNorm -> grouped-query attention with RoPE (through `F.scaled_dot_product_attention`, or for packed rows a
document mask: kiln.trainer.model.documents) -> RMSNorm -> SwiGLU MLP, repeated `layers` times, then a final
RMSNorm and the output projection.

The other families (Mistral, Qwen2/3, Gemma 2/3) are the same decoder with the departures that
`dims.arch` (kiln.api.presets.Arch) lists as data: q/k/v biases, per-head q/k norms, a GeGLU MLP, Gemma's
(1 + w) norms, scaled embeddings, norms after attention and MLP, soft-capped scores and logits, sliding-window
layers with their own RoPE base. Each is one `if` where it applies; docs/trainer.md says why not one module
per family. A mixture of experts (`dims.moe`: Mixtral, Qwen2/3-MoE, the tiny-moe preset) replaces the MLP of its
layers with kiln.trainer.model.moe.MoE, and the loss given targets adds its router losses.

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

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from kiln.api import ModelDims
from kiln.api.presets import RopeScaling
from kiln.trainer.model import documents, kernels, moe


class RMSNorm(nn.Module):
    """RMSNorm scaling by (offset + weight): Llama's offset 0, Gemma's 1 (its weights are stored around 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (1 + w) in fp32, as transformers' Gemma: in bf16 (FSDP's compute dtype) 1 + w would round w to
        # 1/128. A plain tensor: the fused kernel takes it as it takes w, and autograd routes w's gradient.
        return kernels.rms_norm(x, self.weight.float() + self.offset if self.offset else self.weight, self.eps)


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
           window: int | None = None, softcap: float | None = None, docs=None) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim). `window`: a query sees itself and the window - 1
    positions before it (transformers' sliding window). `softcap`: scores -> softcap * tanh(scores / softcap)
    before the mask, which SDPA cannot do, so those layers take the explicit path (fp32 softmax, as
    transformers' eager attention). `docs`: packed rows' document mask (kiln.trainer.model.documents), a
    (batch, 1, seq, seq) bool tensor ANDed with the rest, or a FlexAttention BlockMask on CUDA."""
    seq = q.shape[-2]
    if window is not None and window >= seq:
        window = None  # the window covers every earlier position: plain causal
    if docs is not None and not isinstance(docs, torch.Tensor):
        return documents.flex_attend(q, k, v, docs, scale=scale, window=window, softcap=softcap)
    if window is None and softcap is None and docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    pos = torch.arange(seq, device=q.device)
    offset = pos[:, None] - pos[None, :]  # query position - key position
    mask = (offset >= 0) & (offset < window) if window is not None else offset >= 0
    if docs is not None:  # a document is contiguous: the window's distance is the same within it
        mask = mask & docs
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


class Attention(nn.Module):
    """Causal grouped-query attention: kv_heads key/value heads shared by heads // kv_heads query heads each."""

    def __init__(self, dims: ModelDims, sliding: bool = False):
        super().__init__()
        arch = dims.arch
        self.head_dim = dims.head_dim
        self.n_rep = dims.heads // dims.kv_heads
        self.wq = nn.Linear(dims.dim, dims.heads * self.head_dim, bias=arch.qkv_bias)
        self.wk = nn.Linear(dims.dim, dims.kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.wv = nn.Linear(dims.dim, dims.kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.wo = nn.Linear(dims.heads * self.head_dim, dims.dim, bias=arch.o_bias)
        # Qwen3 / Gemma 3: each query and key head normalised over head_dim, before RoPE
        self.q_norm = RMSNorm(self.head_dim, dims.norm_eps, arch.norm_offset) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, dims.norm_eps, arch.norm_offset) if arch.qk_norm else None
        self.scale = arch.query_scale
        self.window = arch.sliding_window if sliding else None
        self.softcap = arch.attn_softcap

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        """cos/sin: (positions, head_dim // 2) tables, or (bsz, seq, head_dim // 2) per token for packed rows, whose
        `mask` keeps documents apart (kiln.trainer.model.documents; None: plain causal)."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 3:  # per-token angles: rotate the rows as one long sequence of bsz * seq positions
            flat = (1, bsz * seq, -1, self.head_dim)
            q, k = kernels.apply_rope(q.reshape(flat), k.reshape(flat), cos.reshape(bsz * seq, -1),
                                      sin.reshape(bsz * seq, -1))
            q, k = q.view(bsz, seq, -1, self.head_dim), k.view(bsz, seq, -1, self.head_dim)
        else:
            q, k = kernels.apply_rope(q, k, cos[:seq], sin[:seq])
        # (bsz, heads, seq, head_dim) for SDPA; repeat each kv head for its group of query heads.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_rep > 1:  # a copy of k and v, even for n_rep 1
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = attend(q, k, v, scale=self.scale, window=self.window, softcap=self.softcap, docs=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x), act silu (SwiGLU) or tanh-approximated gelu (Gemma's GeGLU)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.gate = kernels.swiglu if activation == "silu" else kernels.geglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dims: ModelDims, sliding: bool = False, experts: bool = False):
        super().__init__()
        arch, norm = dims.arch, functools.partial(RMSNorm, dims.dim, dims.norm_eps, dims.arch.norm_offset)
        self.attention_norm = norm()
        self.attention = Attention(dims, sliding)
        self.ffn_norm = norm()
        self.feed_forward = moe_block(dims) if experts else FeedForward(dims.dim, dims.ffn_dim, arch.activation)
        # Gemma: the attention's and the MLP's outputs are normalised too, before each residual add
        self.attention_post_norm = norm() if arch.sandwich_norm else None
        self.ffn_post_norm = norm() if arch.sandwich_norm else None
        self.local_rope = sliding and arch.local_rope_theta is not None  # Gemma 3: its own RoPE base

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        # mask as a keyword: tensor parallelism's input plan covers (x, cos, sin) only
        a = self.attention(self.attention_norm(x), cos, sin, mask=mask)
        h = x + (a if self.attention_post_norm is None else self.attention_post_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.ffn_post_norm is None else self.ffn_post_norm(f))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab), or the mean loss when targets are given; with `doc_ids`
    (batch, seq), packed rows (data.packing): attention stays within each document and positions restart at
    each one's first token (kiln.trainer.model.documents)."""

    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        sliding = set(dims.arch.sliding_layers)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(dims.vocab_size, dims.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dims, i in sliding, i in moe_layers(dims))
                                     for i in range(dims.layers)})
        # routed tokens per expert since the last read (the step's metrics); a layer's row: its rank among MoE layers
        self.moe_rows = {str(layer): row for row, layer in enumerate(sorted(moe_layers(dims)))}
        self.router_load = moe.RouterLoad(len(self.moe_rows), dims.moe.experts if dims.moe is not None else 0)
        self.norm: RMSNorm | None = RMSNorm(dims.dim, dims.norm_eps, dims.arch.norm_offset)
        self.output: nn.Linear | None = nn.Linear(dims.dim, dims.vocab_size, bias=False)
        # Derived, never checkpointed: recomputed by init_buffers on the real device.
        for name, (cos, sin) in self._rope_tables().items():
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)
        # The fused linear+cross-entropy needs the whole output weight and the last hidden state in one
        # place; under tensor or pipeline parallelism the loss is taken from the logits instead, and so it
        # is when the logits are soft-capped (Gemma 2), which the fused kernel does not do.
        self.fused_loss = dims.arch.final_softcap is None

    def _rope_tables(self, device=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        d = self.dims
        tables = {"rope": rope_tables(d.head_dim, d.seq_len, d.rope_theta, device, scaling=d.rope_scaling)}
        if d.arch.local_rope_theta is not None:  # Gemma 3's sliding layers: another base, no scaling
            tables["rope_local"] = rope_tables(d.head_dim, d.seq_len, d.arch.local_rope_theta, device)
        return tables

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.blocks(self.embed(tokens), doc_ids)
        loss = self.head(h, targets)
        stats = self.router_stats()
        if stats and targets is not None:  # the router losses join the loss as transformers adds them
            loss = loss + self.router_loss(moe.router_totals(stats))
        return loss

    def stage_forward(self, x: torch.Tensor, carry: torch.Tensor | None = None,
                      doc_ids: torch.Tensor | None = None):
        """A pipeline stage's forward (kiln.trainer.parallel.parallelize.split_for_stage makes it the stage's:
        torch's PipelineStage hands a stage the previous one's outputs as positional inputs). The first stage
        takes tokens, the others hidden states; the last returns the logits. A mixture of experts also passes
        its `carry` from stage to stage, the router totals of the layers so far (moe.router_totals: with
        gradient, which the schedule sends back like the hidden states'), and the last stage returns (logits,
        router loss of the whole model): exactly what `forward` adds to the loss, which PipelineLoss adds."""
        h = self.blocks(self.embed(x) if self.tok_embeddings is not None else x, doc_ids)
        if self.dims.moe is not None:
            stats = self.router_stats()
            if carry is None and not stats:  # a first stage of dense layers only: nothing routed yet
                carry = moe.no_totals(self.dims.moe.experts, h.device)
            carry = moe.router_totals(stats, carry)
        if self.norm is not None:
            logits = self.head(h)
            # the loss as a (1,) tensor: the schedule concatenates each output over the microbatches
            return logits if self.dims.moe is None else (logits, self.router_loss(carry).reshape(1))
        return h if self.dims.moe is None else (h, carry)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.dims.arch.embed_scale:  # Gemma; sqrt(dim) rounded to the activations' dtype, as transformers
            h = h * torch.tensor(self.dims.dim ** 0.5, dtype=h.dtype)
        return h

    def blocks(self, h: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        docs = documents.Documents.of(doc_ids) if doc_ids is not None else None
        for block in self.layers.values():
            cos, sin = ((self.rope_local_cos, self.rope_local_sin) if block.local_rope
                        else (self.rope_cos, self.rope_sin))
            if docs is not None:  # each token's angles from its position in its document
                cos, sin = cos[docs.positions], sin[docs.positions]
            h = block(h, cos, sin, mask=None if docs is None else docs.mask)
        return h

    def router_stats(self) -> list[moe.RouterStats]:
        """The router statistics of this forward's MoE layers (those this part holds), added to the step's
        metrics (router_load) here, once per forward."""
        held = [(name, b.feed_forward.stats) for name, b in self.layers.items() if isinstance(b.feed_forward, moe.MoE)]
        if held:
            self.router_load.add([s for _, s in held], [self.moe_rows[name] for name, _ in held])
        return [s for _, s in held]

    def router_loss(self, totals: torch.Tensor) -> torch.Tensor:
        """aux_loss_coef x load-balancing loss + z_loss_coef x z-loss (router_aux_loss_coef in transformers),
        from the router totals over every MoE layer; both also go to the step's metrics."""
        c = self.dims.moe
        aux, z = moe.router_losses(totals, c.experts)
        self.router_load.losses(aux, z)
        return c.aux_loss_coef * aux + c.z_loss_coef * z

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, then the logits, or the loss when targets are given (kiln.trainer.parallel.parallelize compiles it
        when the reference kernels run)."""
        h = self.norm(h)
        if targets is not None and self.fused_loss:
            return kernels.fused_linear_cross_entropy(h, self.output.weight, targets)
        logits = self.output(h)
        cap = self.dims.arch.final_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits if targets is None else cross_entropy(logits, targets)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The derived, non-checkpointed buffers (RoPE tables) on the real device; weights are left as they are
        (for a model whose weights are loaded instead, kiln.trainer.model.hf_folder)."""
        for name, (cos, sin) in self._rope_tables(self.rope_cos.device).items():
            getattr(self, f"{name}_cos").copy_(cos)
            getattr(self, f"{name}_sin").copy_(sin)

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
                full.fill_(1.0 - self.dims.arch.norm_offset)  # a scale of 1
            elif name.endswith(".bias"):
                full.zero_()
            else:
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
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


def moe_layers(dims: ModelDims) -> set[int]:
    """The layers whose MLP is a mixture of experts (all but moe.dense_layers; none for a dense model)."""
    return set(range(dims.layers)) - set(dims.moe.dense_layers) if dims.moe is not None else set()


def moe_block(dims: ModelDims) -> moe.MoE:
    c = dims.moe
    return moe.MoE(dims.dim, c.experts, c.ffn_dim, c.top_k, score=c.score, norm_topk=c.norm_topk,
                   shared_hidden=c.shared_ffn_dim, shared_gate=c.shared_gate)


def build_model(dims: ModelDims) -> Transformer:
    """The model on the meta device: shapes only, no memory; parallelize, then to_empty + init_weights."""
    with torch.device("meta"):
        return Transformer(dims)


def count_params(dims: ModelDims, *, embedding: bool = True, active: bool = False) -> int:
    """Parameters of the full model from its dims (the input embedding is a lookup, not a matmul); `active`: those
    one token's forward uses (a mixture of experts counts its top-k experts only)."""
    hd, arch = dims.head_dim, dims.arch
    attn = dims.dim * hd * (2 * dims.heads + 2 * dims.kv_heads)
    attn += arch.qkv_bias * hd * (dims.heads + 2 * dims.kv_heads) + arch.o_bias * dims.dim + arch.qk_norm * 2 * hd
    dense = 3 * dims.dim * dims.ffn_dim
    sparse = len(moe_layers(dims))
    per_layer = attn + (4 if arch.sandwich_norm else 2) * dims.dim
    total = dims.layers * per_layer + (dims.layers - sparse) * dense + dims.dim + dims.vocab_size * dims.dim
    if sparse:
        total += sparse * moe_params(dims, active=active)
    return total + (dims.vocab_size * dims.dim if embedding else 0)


def moe_params(dims: ModelDims, *, active: bool = False) -> int:
    """One MoE layer's parameters: router, experts (only the top-k a token takes when `active`), shared expert."""
    c = dims.moe
    experts = c.top_k if active else c.experts
    return (c.experts * dims.dim + experts * 3 * dims.dim * c.ffn_dim + 3 * dims.dim * c.shared_ffn_dim
            + c.shared_gate * dims.dim)
