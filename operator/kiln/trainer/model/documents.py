"""Attention over packed sequences (data.packing): several documents in one row, told apart by a document id per
token, attend only within their own document, with positions that restart at each document's first token.

`Documents.of(doc_ids)` builds, once per forward, what every block needs: the per-token RoPE positions and the
attention mask, in the form the attention kernel takes:
- CUDA: FlexAttention (torch.nn.attention.flex_attention) under torch.compile with a `BlockMask` from the
  document ids: blocks of the (query, key) grid that cross documents are skipped, not computed and masked;
- elsewhere (the CPU): `F.scaled_dot_product_attention` with a boolean (rows, 1, seq, seq) mask, causal and
  block-diagonal by document. Exact; its memory grows with seq_len², which CPU runs here are far from.
The mask depends on the row only, not on the head: under tensor parallelism each rank's share of the heads
takes it unchanged; under pipeline parallelism every stage gets the microbatch's ids (kiln.trainer.run).
Padding is a document of its own (the data side gives it an id): every query sees at least itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_compiled_flex = None  # torch.compile(flex_attention), made on first use on CUDA


def uses_flex(device: torch.device) -> bool:
    return device.type == "cuda"


def describe(device: torch.device) -> str:
    """One line for the start of a packed run: which attention kernel keeps documents apart."""
    if uses_flex(device):
        return "packed sequences: FlexAttention (compiled) with a document block mask"
    return (f"packed sequences: SDPA with a boolean causal, block-diagonal document mask (the run is on "
            f"{device.type.upper()}, where FlexAttention does not fuse)")


def positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(rows, seq) index of each token within its document: 0 at the first token of each document."""
    seq = doc_ids.shape[-1]
    index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts


@dataclass
class Documents:
    """What a packed forward passes to every block: RoPE positions and the mask (a BlockMask or a bool tensor)."""

    positions: torch.Tensor  # (rows, seq)
    mask: object

    @classmethod
    @torch.compiler.disable  # built outside any compiled graph (a whole-model compile breaks here), as TorchTitan does
    def of(cls, doc_ids: torch.Tensor) -> "Documents":
        return cls(positions(doc_ids), block_mask(doc_ids) if uses_flex(doc_ids.device) else dense_mask(doc_ids))


def dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(rows, 1, seq, seq) True where query i may attend key j: same document and j <= i."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal


def block_mask(doc_ids: torch.Tensor):
    """FlexAttention's BlockMask of the same rule as dense_mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    rows, seq = doc_ids.shape
    return create_block_mask(same_document_causal, rows, None, seq, seq, device=doc_ids.device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *, scale: float | None = None,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """FlexAttention under a document BlockMask; a sliding window and score soft-capping as its score_mod."""
    score_mod = None
    if window is not None or softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            if window is not None:
                score = torch.where(q_idx - kv_idx < window, score, -float("inf"))
            return score
    return _flex()(q, k, v, block_mask=block_mask, score_mod=score_mod, scale=scale)


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # eager flex_attention materialises the whole score matrix; compiled, it is one fused kernel
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex
