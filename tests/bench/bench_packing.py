"""data.packing against padding on short conversations: tokens of real (non-padding) data trained per second, both
in the same run on the same model, data and machine.

Conversations: pydoc paragraphs (the English help text that ships with Python), each a user turn (the first 40
characters of a paragraph's first line) and an assistant turn (the paragraph, cut to --max-words words), rendered
and masked by `kiln data prepare --format chat` with the test tokenizer and Llama-3-style template of
tests/chat_models.py; the median conversation must be under a quarter of --seq-len (checked, reported). Both ways
train the same kiln Transformer (fp32, AdamW) on rows of seq_len tokens, --batch rows a step, for --steps timed
steps after one untimed one, alternating between the two ways --repeats times so the machine's load falls on both
alike:

- padding: one conversation per row, the rest padding (no loss on it; plain causal attention);
- packing: the loader's packed rows (kiln.trainer.data.packing: whole conversations, best-fit decreasing), with
  the document mask (on the CPU: SDPA with a boolean block-diagonal mask; FlexAttention on CUDA).

Reported: real tokens (conversation tokens in the rows' inputs) and assistant tokens per second of each, the ratio
packing/padding (target >= 2), the conversations' length distribution and the rows' fill, with the machine's load.

    python -m tests.bench.bench_packing [--seq-len 512 --steps 4 --repeats 3 --out runs/bench/packing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tests.bench.report import write_report


def conversations(max_words: int) -> list[list[dict]]:
    from kiln.trainer.data.loader import pydoc_bytes

    paragraphs = [p.strip() for p in pydoc_bytes().decode().split("\n\n") if len(p.strip()) > 40]
    return [[{"role": "user", "content": f"({i}) {p.splitlines()[0][:40]}"},
             {"role": "assistant", "content": " ".join(p.split()[:max_words])}] for i, p in enumerate(paragraphs)]


def padded_rows(source, seq_len: int) -> list[tuple[torch.Tensor, ...]]:
    """One conversation per row, padded: the same conversations (the packed source's pieces) as the packed rows."""
    from kiln.trainer.data.packing import pack_row

    rows = []
    for start, length in zip(source.starts.tolist(), source.lengths.tolist()):
        tokens = source._span(source.arrays, start, length).astype(np.int64)
        mask = source._span(source.masks, start, length).astype(np.bool_)
        rows.append(pack_row([tokens], [mask], seq_len + 1))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-words", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/packing.json")
    args = ap.parse_args(argv)
    from kiln.api import ModelDims
    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.data.packing import PAD_DOC
    from kiln.trainer.data.prepare import prepare
    from kiln.trainer.model.documents import describe
    from kiln.trainer.model.transformer import build_model
    from tests.chat_models import save_chat_folder

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-packing-") as tmp:
        root = Path(tmp)
        folder = save_chat_folder(root / "model")
        (root / "src").mkdir()
        convs = conversations(args.max_words)
        (root / "src" / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in convs))
        prepare([str(root / "src")], tokenizer_uri=f"file://{folder}", output=f"file://{root / 'data'}",
                format="chat", log=lambda m: None)
        source = open_source(f"file://{root / 'data'}", seq_len=args.seq_len, vocab_size=384, seed=0, chat=True,
                             packing=True)
        lengths = source.lengths
        if np.median(lengths) >= args.seq_len / 4:
            raise SystemExit(f"the median conversation has {np.median(lengths):.0f} tokens, not under a quarter of "
                             f"--seq-len {args.seq_len}: lower --max-words")
        packed_loader = GlobalBatchLoader(source, seed=0)
        padded = padded_rows(source, args.seq_len)
        order = torch.randperm(len(padded), generator=torch.Generator().manual_seed(0)).tolist()

    dims = ModelDims(dim=args.dim, layers=args.layers, heads=4, kv_heads=4, vocab_size=384, seq_len=args.seq_len,
                     ffn_dim=4 * args.dim)
    model = build_model(dims)
    model.to_empty(device=device)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pad_cursor = 0

    def padded_batch():
        nonlocal pad_cursor
        chosen = [padded[order[(pad_cursor + i) % len(order)]] for i in range(args.batch)]
        pad_cursor += args.batch
        return tuple(torch.stack(parts) for parts in zip(*chosen))

    def run(way: str) -> tuple[float, int, int]:
        """(seconds, real tokens, assistant tokens) of --steps timed steps, after one untimed one."""
        seconds, real, assistant = 0.0, 0, 0
        for step in range(args.steps + 1):
            inputs, targets, doc_ids = packed_loader.next_batch(args.batch) if way == "packing" else padded_batch()
            docs = {"doc_ids": doc_ids.to(device)} if way == "packing" else {}
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(inputs.to(device), targets.to(device), **docs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step:  # the first: allocations, kernel selection
                seconds += time.perf_counter() - t0
                real += int((doc_ids != PAD_DOC).sum())
                assistant += int((targets != -100).sum())
        return seconds, real, assistant

    measured: dict[str, list[dict]] = {"padding": [], "packing": []}
    for _ in range(args.repeats):
        for way in ("padding", "packing"):
            s, real, assistant = run(way)
            measured[way].append({"seconds": s, "real_tokens": real, "assistant_tokens": assistant,
                                  "real_tokens_per_second": real / s, "assistant_tokens_per_second": assistant / s})
    med = {way: statistics.median(r["real_tokens_per_second"] for r in runs) for way, runs in measured.items()}
    med_assistant = {way: statistics.median(r["assistant_tokens_per_second"] for r in runs)
                     for way, runs in measured.items()}
    result = {
        "benchmark": "packing", "host": platform.node(), "cpus": os.cpu_count(), "device": str(device),
        "load_average": os.getloadavg()[0], "commit": _commit(), "torch": torch.__version__,
        "attention": describe(device),
        "model": {"dim": args.dim, "layers": args.layers, "seq_len": args.seq_len, "batch_rows": args.batch,
                  "precision": "fp32"},
        "conversations": len(lengths), "conversation_tokens_median": float(np.median(lengths)),
        "conversation_tokens_p90": float(np.percentile(lengths, 90)), "conversation_tokens_max": int(lengths.max()),
        "packed_rows": len(source), "padded_rows": len(padded),
        "packed_fill": float(lengths.sum() / (len(source) * (args.seq_len + 1))),
        "runs": measured, "real_tokens_per_second_median": med,
        "assistant_tokens_per_second_median": med_assistant,
        "speedup_real_tokens_packing_over_padding": med["packing"] / med["padding"],
    }
    write_report(result, args.out, summary={k: result[k] for k in (
        "load_average", "conversation_tokens_median", "packed_fill", "real_tokens_per_second_median",
        "speedup_real_tokens_packing_over_padding")})
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
