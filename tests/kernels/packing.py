"""Packed rows on a device: the CUDA path of `data.packing` (compiled FlexAttention with a document BlockMask, and
a family's sliding window and score soft-capping as its score_mod) gives each document's logits, loss and
gradients as if it ran alone. tests/unit/test_packing_model.py checks the same rule on the CPU, where attention
is SDPA with a dense mask; this runs it where `kiln.trainer.model.documents` takes FlexAttention.

Per model (a Llama-like one; a Gemma-2-like one: a sliding window shorter than the documents, soft-capped
scores and logits, a local RoPE base), fp32, one packed row of documents of several lengths and padding:
- logits: the packed row's, at each document's positions, against the document run alone (plain causal);
- loss: the packed row's against the token-weighted mean of the documents' losses;
- gradients: of the packed loss against those of that mean, each parameter's largest difference relative to
  its largest gradient element.
The bounds (TOLERANCES) are looser than the CPU test's 1e-5: two different attention kernels sum in different
orders. Each figure is reported with its bound; the exit status is 1 when one is over it.

    python -m tests.kernels.packing --device cuda [--out runs/bench/packing_cuda.json]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from kiln.api import ModelDims
from kiln.trainer.data.packing import pack_row
from kiln.trainer.model import documents
from kiln.trainer.model.transformer import build_model

DIMS = ModelDims(dim=64, layers=2, heads=4, kv_heads=2, vocab_size=128, seq_len=256, ffn_dim=96)
LENGTHS = [60, 17, 100, 41, 30]  # 248 tokens of 257: the row ends in padding; several 128-blocks are crossed
TOLERANCES = {"logits": 1e-4, "loss_rel": 1e-5, "grad_rel": 1e-4}


def _model(dims: ModelDims, device: str):
    torch.manual_seed(0)
    m = build_model(dims)
    m.to_empty(device=device)
    m.init_weights(0)
    m.init_buffers()
    return m


def _gemma2_like() -> ModelDims:
    from kiln.api.presets import Arch

    arch = Arch(family="gemma2", sliding_window=16, sliding_layers=(0,), attn_softcap=20.0, final_softcap=10.0,
                local_rope_theta=1000.0, sandwich_norm=True, norm_offset=1.0, embed_scale=True)
    return DIMS.model_copy(update={"arch": arch})


def packed_equals_alone(dims: ModelDims, device: str, seed: int = 0) -> dict:
    """The three comparisons above for one model: the largest differences found."""
    model = _model(dims, device)
    gen = np.random.default_rng(seed)
    docs = [gen.integers(1, dims.vocab_size, n) for n in LENGTHS]
    inputs, targets, doc_ids = (t[None].to(device) for t in pack_row(docs, None, dims.seq_len + 1))

    with torch.no_grad():
        logits = model(inputs, doc_ids=doc_ids)[0]
        logits_diff, at = 0.0, 0
        for doc in docs:
            alone = torch.from_numpy(doc)[None, :-1].to(device)
            ref = model(alone)[0]
            logits_diff = max(logits_diff, float((logits[at:at + len(doc) - 1] - ref).abs().max()))
            at += len(doc)

    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    packed_loss = model(inputs, targets, doc_ids=doc_ids)
    packed_loss.backward()
    packed_grads = {n: p.grad.detach().clone() for n, p in params.items()}

    model.zero_grad(set_to_none=True)
    count = sum(len(d) - 1 for d in docs)
    mean = 0.0
    for doc in docs:  # the token-weighted mean: kiln's loss over the global batch's loss-carrying tokens
        alone = torch.from_numpy(doc)[None].to(device)
        mean = mean + model(alone[:, :-1], alone[:, 1:]) * (len(doc) - 1) / count
    mean.backward()
    grad_rel = max(float((packed_grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30))
                   for n, p in params.items())
    return {"logits_max_abs_diff": logits_diff,
            "loss_rel_diff": abs(packed_loss.item() - mean.item()) / abs(mean.item()),
            "grad_max_rel_diff": grad_rel, "loss_tokens": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: tests/unit/test_packing_model.py checks the CPU path", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    result = {"check": "packing", "device": torch.cuda.get_device_name() if device.type == "cuda" else args.device,
              "torch": torch.__version__, "attention": documents.describe(device), "lengths": LENGTHS,
              "seq_len": DIMS.seq_len, "tolerances": TOLERANCES, "models": {}}
    failed = []
    for name, dims in (("llama-like", DIMS), ("gemma2-like (window 16, soft-capping)", _gemma2_like())):
        try:
            got = packed_equals_alone(dims, args.device)
        except Exception as e:  # the compiled kernel failing to build is a finding too; the other model still runs
            got = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        over = ("error" in got or got["logits_max_abs_diff"] > TOLERANCES["logits"]
                or got["loss_rel_diff"] > TOLERANCES["loss_rel"] or got["grad_max_rel_diff"] > TOLERANCES["grad_rel"])
        got["ok"] = not over
        if over:
            failed.append(name)
        result["models"][name] = got
        print(f"{'ok' if not over else 'FAIL':5s} {name}: {got}", flush=True)
    result["failed"] = failed
    if args.out:
        from tests.bench.report import write_report

        write_report(result, args.out, summary={"wrote": args.out, "failed": failed})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
